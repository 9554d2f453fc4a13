"""The rollout interface: requests (a prompt and a number of samples, a token budget), what every engine returns,
when the trainer syncs weights, and how it builds requests from a process's rows."""

from __future__ import annotations

import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.algo.sampling import SamplingSettings
from grpo.base.records import Request, Rollout
from grpo.data.prompts import PromptSource, end_of_turn_ids, make_prompt
from grpo.rollout import build_engine
from grpo.rollout.fast import FastEngine
from grpo.rollout.plain import TransformersEngine
from grpo.serve.launcher import thread_binding
from support.rewards import length_reward
from support.runs import cfg, chat_dataset
from support.scripted import ScriptedEngine
from support.tiny import make_model, make_tokenizer


def engines(**kw):
    tok = make_tokenizer()
    model = make_model(tok).eval()
    args = GRPOConfig(output_dir="x", max_completion_length=12, per_device_train_batch_size=4, num_generations=2, **kw)
    stop = end_of_turn_ids(tok, model.generation_config.eos_token_id)
    # the fast engine on the transformers forward, so that a hook on the output head reaches both
    sampling = SamplingSettings.of(args)
    both = [FastEngine(model, tok, sampling, stop, lean=False), TransformersEngine(model, tok, sampling, stop)]
    return tok, model, both


@pytest.mark.parametrize("which", [0, 1], ids=["fast", "plain"])
def test_every_engine_answers_requests_in_order_with_budgets_and_messages(which):
    """Rows come request by request, a request's samples consecutive; a request's max_tokens caps its rows (cut
    there: truncated); conversational prompts get the completion as one assistant message, standard ones none;
    every row has its sampling log-probs and a loss mask of ones."""
    tok, model, all_engines = engines()
    engine = all_engines[which]
    chat = make_prompt([{"role": "user", "content": "hi"}], tok)
    text = make_prompt("Say something.", tok)
    # no stop token can come: every row runs to its budget
    stops = torch.tensor(sorted(set(end_of_turn_ids(tok, model.generation_config.eos_token_id))))
    handle = model.lm_head.register_forward_hook(lambda m, i, out: out.index_fill(-1, stops, -1e4))
    try:
        rollout = engine.generate([Request(chat, num_samples=3), Request(text, num_samples=2, max_tokens=4)])
    finally:
        handle.remove()
    assert len(rollout) == 5
    assert rollout.prompt_ids == [list(chat.ids)] * 3 + [list(text.ids)] * 2
    assert [len(c) for c in rollout.completion_ids] == [12, 12, 12, 4, 4] and all(rollout.truncated)
    assert [len(lp) for lp in rollout.sampling_logps] == [len(c) for c in rollout.completion_ids]
    assert all(lp <= 0 for row in rollout.sampling_logps for lp in row)
    assert rollout.loss_mask == [[1] * len(c) for c in rollout.completion_ids]
    assert rollout.texts == tok.batch_decode(rollout.completion_ids, skip_special_tokens=True)
    assert rollout.messages[:3] == [[{"role": "assistant", "content": t}] for t in rollout.texts[:3]]
    assert rollout.messages[3:] == [None, None]
    assert rollout.completions[3:] == rollout.texts[3:]  # what reward functions see


def test_build_engine_picks_the_fast_engine_and_says_why_not(caplog):
    tok, model, _ = engines()
    accelerator = type("Acc", (), {"mixed_precision": "no", "autocast": None})()
    stop = end_of_turn_ids(tok)
    assert build_engine(model, tok, GRPOConfig(output_dir="x"), stop, accelerator).name == "fast"
    with caplog.at_level("INFO", logger="grpo"):
        engine = build_engine(model, tok, GRPOConfig(output_dir="x", generation_kwargs={"top_k": 3}), stop, accelerator)
    assert engine.name == "transformers" and "generation_kwargs" in caplog.text


def test_prompt_source_tokenizes_once_and_groups_a_process_share():
    tok = make_tokenizer()
    data = [{"prompt": [{"role": "user", "content": "a"}]}, {"prompt": "b"}]
    source = PromptSource(data, tok)
    first = source[0]
    assert source[0] is first and first.messages == ({"role": "user", "content": "a"},)
    assert source[1].messages is None and list(source[1].ids) == tok("b")["input_ids"]
    # a process holding the last 3 samples of prompt 0 and the first 2 of prompt 1
    requests = source.requests([0, 0, 0, 1, 1])
    assert [(r.prompt, r.num_samples) for r in requests] == [(source[0], 3), (source[1], 2)]


def test_weights_are_synced_lazily_before_generating(tiny_model_dir, tmp_path):
    """Before the first generation, and before each later generation that follows an optimizer step: with
    steps_per_generation 2, every other step; again after a resume."""
    args = cfg(
        tmp_path,
        per_device_train_batch_size=4,
        steps_per_generation=2,
        max_steps=4,
        save_strategy="steps",
        save_steps=3,
    )
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    engine = trainer.engine = ScriptedEngine(trainer.processing_class)
    generated = []
    original = engine.generate
    engine.generate = lambda requests: generated.append(engine.syncs) or original(requests)
    trainer.train()
    assert generated == [1, 2]  # generations at steps 1 and 3, each after a sync
    resumed = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    resumed.engine = again = ScriptedEngine(resumed.processing_class)
    resumed.train(resume_from_checkpoint=True)  # from checkpoint-3, mid-cycle: step 4 trains on buffered rows
    assert again.syncs == 0 and resumed.state.global_step == 4
    args.max_steps = 5  # a longer run from the newest checkpoint: its step 5 generates
    longer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    longer.engine = again = ScriptedEngine(longer.processing_class)
    longer.train(resume_from_checkpoint=True)
    assert again.syncs == 1


def test_rollout_select_and_concat_keep_rows_together():
    rollout = Rollout(
        prompt_ids=[[1], [2]],
        completion_ids=[[3], [4, 5]],
        sampling_logps=[[-1.0], [-2.0, -3.0]],
        truncated=[False, True],
        texts=["c", "de"],
        messages=[None, [{"role": "assistant"}]],
    )
    both = Rollout.concat([rollout.select([1]), rollout.select([0])])
    assert both.completion_ids == [[4, 5], [3]] and both.texts == ["de", "c"] and both.loss_mask == [[1, 1], [1]]
    assert both.messages == [[{"role": "assistant"}], None] and both.truncated == [True, False]


def test_a_tensor_parallel_servers_shards_get_equal_shares_of_the_cpus():
    assert thread_binding([0, 1], 2) == "0|1"
    assert thread_binding([0, 1, 2, 3, 4], 2) == "0,1,2|3,4"  # the first shards take the remainder
    assert thread_binding([4, 5, 6, 7], 4) == "4|5|6|7"
    assert thread_binding([0], 2) == "nobind"  # fewer CPUs than shards: vLLM's threads unbound
