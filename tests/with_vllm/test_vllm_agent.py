"""A tool loop through the vLLM engines, colocate and the session's `grpo vllm-serve` server: the first turns (which
call the tool) come from a rollout_func, scripted, with the policy's own log-probs; every follow-up turn after the tool
result is sampled by vLLM, one sample per row, from the sequence so far (prompt, the call, the tool turn's tokens).
The sampling/* metrics then compare vLLM's log-probs with the policy's on model tokens only: they agree to float32
rounding, so the tool tokens (whose placeholder log-prob 0.0 is far from the policy's) take no part."""

from __future__ import annotations

import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.agent import CHATML_TOOLS
from grpo.data.prompts import make_prompt
from support import tiny
from support.agent import CALL, multiply
from support.runs import BASE, chat_dataset
from support.vllm_runs import FP32_TOL, policy_logps


@pytest.fixture(scope="module")
def tools_model_dir(tmp_path_factory):
    """The tiny vLLM-compatible Llama with the tool-capable template and room (2048 positions) for its schemas."""
    tok = tiny.make_tokenizer()
    tok.chat_template = CHATML_TOOLS
    model_dir = tmp_path_factory.mktemp("tiny-tools") / "tiny-tools"
    tiny.make_model(tok, hidden=128, context=2048).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return str(model_dir)


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_follow_up_turns_are_sampled_by_vllm(tools_model_dir, tmp_path, mode, servers):
    """Server mode on the session's server (the same tiny Llama; the run pushes its weights first)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tools_model_dir)
    extra = {"vllm_mode": "server", "vllm_server_port": servers.open} if mode == "server" else {}

    def first_turns(prompts, trainer):
        schemas = trainer.parts.rollouts.tools.schemas
        call = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        prompt_ids = [list(make_prompt(p, tok, tools=schemas).ids) for p in prompts]
        logps = [policy_logps(trainer, ids, call).tolist() for ids in prompt_ids]
        return {"prompt_ids": prompt_ids, "completion_ids": [call] * len(prompts), "logprobs": logps}

    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        **{**BASE, "use_vllm": True, "max_completion_length": 160, "max_tool_calling_iterations": 1, **extra},
    )
    trainer = GRPOTrainer(
        model=tools_model_dir,
        processing_class=tok,
        reward_funcs=lambda completions, **kw: [float(len(c[-1]["content"])) for c in completions],
        train_dataset=chat_dataset(tasks=False),
        args=args,
        tools=[multiply],
        rollout_func=first_turns,
    )
    asked, generate = [], trainer.engine.generate

    def recording(requests):
        asked.append(list(requests))
        return generate(requests)

    trainer.engine.generate = recording
    before = {n: p.detach().clone() for n, p in trainer.unwrapped_model.named_parameters()}
    trainer.train()
    assert len(asked) == 1 and [r.num_samples for r in asked[0]] == [1] * 8  # the follow-up turns, one per row
    suffix = tok("\n<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert list(asked[0][0].prompt.ids[-len(suffix) :]) == suffix
    row = trainer.state.log_history[-1]
    assert row["tools/call_frequency"] == 1.0 and row["tools/failure_frequency"] == 0.0
    assert row["sampling/sampling_logp_difference/max"] < FP32_TOL
    assert any(not torch.equal(p, before[n]) for n, p in trainer.unwrapped_model.named_parameters())
