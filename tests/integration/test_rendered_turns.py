"""`turn_context`: with a chat template that strips earlier reasoning (DeepSeek-R1's way), each tool-loop turn after
the first is sampled after the conversation as the template renders it, the row's turns say which context each
token followed, and the training pass scores every sampled token after exactly that context (its log-probs equal the
sampler's), as token trees and as forked rows alike; `auto` picks it for such a template only; where the rendering
continues the tokens so far, rendered turns are the appended ones; `appended` keeps TRL's behaviour."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from grpo import GRPOTrainer
from grpo.agent import CHATML_TOOLS
from grpo.agent.template import rerendering
from grpo.learner.batch import collate
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings
from support.agent import CALL, GROUPS, STRIPPING, cfg, dataset, multiply, tool_tokenizer
from support.runs import generate, params
from support.scripted import ScoredTurnScript, TurnScript
from support.tiny import make_model

THINK = "<think>first I multiply</think>"


def reason_call_answer(text, turn, j):
    """Even samples reason, call multiply, then answer 6 after more reasoning; odd ones answer at once."""
    if turn == 0 and j % 2 == 0:
        return THINK + CALL
    return "<think>so</think>6"


def answered_after_a_call(completions, **kw):
    """1 for an exchange that called the tool and then answered 6 (after its reasoning), else 0: a spread within
    each group, so the updates are not zero."""
    return [1.0 if len(c) > 1 and c[-1]["content"].endswith("6") else 0.0 for c in completions]


def make(tmp_path, template=STRIPPING, sgd=False, peft_config=None, **args):
    """A trainer with the tool and `template`, whose engine samples `reason_call_answer` and reports the model's
    log-probs of it after each request's prompt; with `sgd`, plain SGD (an update linear in the gradient)."""
    tok = tool_tokenizer()
    tok.chat_template = template
    model = make_model(tok, context=4096)
    trainer = GRPOTrainer(
        model=model,
        processing_class=tok,
        reward_funcs=answered_after_a_call,
        train_dataset=dataset(),
        args=cfg(tmp_path, max_steps=2, temperature=0.9, **args),
        tools=[multiply],
        optimizers=(torch.optim.SGD(model.parameters(), lr=1e-2), None) if sgd else (None, None),
        peft_config=peft_config,
    )
    trainer.engine = ScoredTurnScript(tok, reason_call_answer, trainer.model, temperature=0.9)
    return trainer


# an opening the generation prompt writes and earlier turns lose (Qwen3's with enable_thinking=False)
EMPTY_THINK = CHATML_TOOLS.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n",
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think></think>",
)
# a tool-calling turn's text after its calls, and once results follow, after them (Gemma 4's way)
TEXT_AFTER_RESULTS = (
    CHATML_TOOLS.replace("<|im_start|>assistant\n{{ message['content'] or '' }}", "<|im_start|>assistant\n")
    .replace(
        "</tool_call>{% endfor %}", "</tool_call>{% endfor %}{% if loop.last %}{{ message['content'] }}{% endif %}"
    )
    .replace(
        "{% else %}<|im_start|>{{ message['role'] }}",
        "{% elif message['role'] == 'tool' %}<|im_start|>tool\n{{ message['content'] }}{{ messages[loop.index0 - 1]"
        "['content'] }}<|im_end|>\n{% else %}<|im_start|>{{ message['role'] }}",
    )
)


def test_auto_renders_turns_only_for_a_template_that_rerenders_earlier_turns():
    tok = tool_tokenizer()
    assert rerendering(tok) is None  # CHATML_TOOLS keeps every turn as it was
    for template, how in [
        (STRIPPING, "drops an earlier turn's reasoning"),
        (EMPTY_THINK, "drops what its generation prompt opens each turn with"),
        (TEXT_AFTER_RESULTS, "renders an earlier turn otherwise once a tool result follows"),
    ]:
        tok.chat_template = template
        assert how in (rerendering(tok) or ""), template


def test_the_template_table_script_names_what_auto_picks(tmp_path):
    """scripts/template_turns.py over a folder of templates: one row each, what auto picks and why."""
    for name, template in [("chatml_tools", CHATML_TOOLS), ("stripping", STRIPPING), ("no_tools", "{{ messages }}")]:
        (tmp_path / f"{name}.jinja").write_text(template)
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "template_turns.py")
    done = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, check=True)
    rows = done.stdout.strip().splitlines()[2:]
    assert rows[0] == "| chatml_tools | yes | appended | appended |"
    assert rows[1].startswith("| no_tools | no: drops the tools it is given") and rows[1].endswith("| - | - |")
    assert rows[2] == (
        "| stripping | yes | rendered: it drops an earlier turn's reasoning | rendered: it drops an earlier turn's "
        "reasoning |"
    )


def test_each_turn_is_sampled_after_the_rendered_history_and_scored_after_it(tmp_path):
    trainer = make(tmp_path)
    tok, engine = trainer.processing_class, trainer.engine
    assert trainer.parts.rollouts.loop.rendered  # auto: the template strips earlier reasoning
    rollout = generate(trainer, GROUPS).rollout
    first, second = engine.turn_ids(THINK + CALL), engine.turn_ids("<think>so</think>6")

    def rendered_history(k):  # prompt k's conversation after the tool's result, as the template renders it
        call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}}
        conversation = [
            {"role": "user", "content": f"2*3 {k}"},
            {"role": "assistant", "content": THINK, "tool_calls": [call]},
            {"role": "tool", "name": "multiply", "content": "6"},
        ]
        text = tok.apply_chat_template(
            conversation, tools=trainer.parts.rollouts.tools.schemas, tokenize=False, add_generation_prompt=True
        )
        return tok(text, add_special_tokens=False)["input_ids"]

    rendered = [rendered_history(k) for k in (0, 1)]
    assert "first I multiply" not in tok.decode(rendered[0])  # the stripped reasoning is not in the next context
    for i in range(8):
        if i % 2 == 0:
            # the completion holds the sampled tokens; the second turn followed the rendered history
            assert rollout.completion_ids[i] == first + second
            assert rollout.loss_mask[i] == [1] * (len(first) + len(second))
            assert rollout.turns[i] == (
                (0, len(first), tuple(rollout.prompt_ids[i])),
                (len(first), len(first) + len(second), tuple(rendered[GROUPS[i]])),
            )
            assert rollout.tool_calls[i] == 1
        else:
            assert rollout.completion_ids[i] == second and rollout.turns[i] is None
    follow_up = engine.requests[1][0]
    assert list(follow_up.prompt.ids) == rendered[0]
    # the budget counts what the next turn continues, past the prompt
    assert follow_up.max_tokens == 200 - (len(rendered[0]) - len(rollout.prompt_ids[0]))
    # each sampled token's training log-prob is its sampling log-prob: the same context, as trees and forked rows
    batch = collate(rollout, torch.zeros(8), tok.pad_token_id, False)
    m = batch.mask.bool()
    sampled = batch.sampling_logps[m]
    for as_trees in (True, False):
        with torch.no_grad():
            logps = token_logps(
                trainer.model,
                batch,
                PassSettings(0.9, with_entropy=False, layouts=("trees" if as_trees else "padded",)),
            ).logps
        torch.testing.assert_close(logps[m], sampled, rtol=1e-5, atol=1e-5)


def test_appended_turns_keep_the_reasoning_the_template_would_strip(tmp_path):
    trainer = make(tmp_path, turn_context="appended")
    tok = trainer.processing_class
    rollout = generate(trainer, GROUPS).rollout
    assert all(t is None for t in rollout.turns)
    assert "first I multiply" in tok.decode(list(trainer.engine.requests[1][0].prompt.ids))
    first = trainer.engine.turn_ids(THINK + CALL)
    assert rollout.completion_ids[0][: len(first)] == first and 0 in rollout.loss_mask[0]  # tool tokens appended


def test_rendered_turns_equal_appended_ones_where_the_rendering_continues_the_tokens(tmp_path):
    """CHATML_TOOLS renders the model's turns as sampled: rendered rows are one sequence, token for token the
    appended rows."""
    rendered = make(tmp_path / "r", template=CHATML_TOOLS, turn_context="rendered")
    appended = make(tmp_path / "a", template=CHATML_TOOLS, turn_context="appended")
    assert rendered.parts.rollouts.loop.rendered and not appended.parts.rollouts.loop.rendered
    one, other = generate(rendered, GROUPS).rollout, generate(appended, GROUPS).rollout
    assert one.completion_ids == other.completion_ids and one.loss_mask == other.loss_mask
    assert all(t is None for t in one.turns)


@pytest.mark.parametrize(
    "setting",
    [{}, {"gradient_checkpointing": True}, {"gradient_accumulation_steps": 2, "beta": 0.04}],
    ids=["plain", "checkpointing", "ga2+kl"],
)
def test_a_tree_run_over_rendered_turns_trains_like_forked_rows(tmp_path, setting):
    """Two steps of SGD over rendered turns: the tree layout's update equals the forked rows' (the padded layout),
    with gradient checkpointing, and with two accumulated micro-batches and a KL term against a reference model
    (whose pass scores the turns too)."""
    runs = {}
    for packing in ("padded", "tree"):
        trainer = make(tmp_path / packing, sgd=True, packing=packing, logging_steps=1, **setting)
        initial = params(trainer.model)  # before the run (the tree run's, after the loop)
        trainer.train()
        runs[packing] = trainer
    assert runs["tree"].training_pass.tree
    assert runs["tree"].state.log_history[0]["tools/call_frequency"] == 0.5
    # the sampling/* metrics show it: each sampled token's training log-prob is its sampling log-prob
    for run in runs.values():
        steps = [row for row in run.state.log_history if "loss" in row]
        assert steps and all(row["sampling/sampling_logp_difference/max"] < 1e-4 for row in steps)
    tree_params = params(runs["tree"].model)
    assert any(not torch.equal(initial[n], v) for n, v in tree_params.items())  # the runs moved the weights
    for name, value in params(runs["padded"].model).items():
        torch.testing.assert_close(tree_params[name], value, rtol=1e-4, atol=1e-6)
    for row, tree_row in zip(runs["padded"].state.log_history, runs["tree"].state.log_history):
        if "loss" in row:
            assert tree_row["loss"] == pytest.approx(row["loss"], rel=1e-4, abs=1e-6)
            if "kl" in row:
                assert tree_row["kl"] == pytest.approx(row["kl"], rel=1e-4, abs=1e-7)


def test_a_lora_policys_turns_score_alike_as_trees_and_forked_rows(tmp_path):
    """LoRA (adapters on q and v): the rendered turns' log-probs and the adapters' gradients from the tree equal
    the forked rows'."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = make(tmp_path, peft_config=lora)
    rollout = generate(trainer, GROUPS).rollout
    assert any(rollout.turns)
    batch = collate(rollout, torch.zeros(8), trainer.processing_class.pad_token_id, False)
    m = batch.mask.bool()

    def pass_(as_trees):
        trainer.model.zero_grad()
        logps = token_logps(
            trainer.model, batch, PassSettings(0.9, with_entropy=False, layouts=("trees" if as_trees else "padded",))
        ).logps
        (logps * batch.mask).sum().backward()
        return logps.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    (forked, grads), (trees, tree_grads) = pass_(False), pass_(True)
    torch.testing.assert_close(trees[m], forked[m], rtol=1e-5, atol=1e-6)
    assert grads and all("lora_" in name for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(tree_grads[name], grad, rtol=1e-5, atol=5e-6)


def test_an_unknown_turn_context_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"turn_context.*'forked'.*'auto', 'appended' or 'rendered'"):
        cfg(tmp_path, turn_context="forked")


def test_async_generation_trains_rendered_turns(tmp_path):
    """async_generation: the producer runs the tool loop with rendered turns and scores its rows' behaviour
    log-probs on its snapshot (turns and all); the learner trains them as trees."""
    trainer = make(tmp_path, async_generation=True, packing="tree", logging_steps=1)
    producer = trainer.parts.rounds.producer
    producer.own_engine = TurnScript(trainer.processing_class, reason_call_answer)  # the producer's, scripted
    assert producer.rollouts.loop.rendered
    before = params(trainer.model)
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.training_pass.tree
    assert any(producer.own_engine.requests[1:])  # follow-up turns were sampled in the producer
    assert trainer.state.log_history[0]["tools/call_frequency"] == 0.5
    assert any(not torch.equal(before[n], v) for n, v in params(trainer.model).items())
