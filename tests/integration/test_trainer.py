"""End-to-end behaviour of GRPOTrainer on tiny local models: the product document's examples, parameter
updates, prompts and columns reaching rewards, the reference model, metrics files, and checkpoints."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re

import pytest
import torch

from grpo import GRPOTrainer
from grpo.base.records import expand
from grpo.rollout.base import assemble
from support.rewards import length_reward, text_of
from support.runs import cfg, chat_dataset, params, text_dataset
from support.scripted import ScriptedEngine
from support.tiny import make_tokenizer


@pytest.mark.parametrize("bf16", [False, True])
def test_one_step_changes_every_trainable_parameter(tiny_model_dir, tmp_path, bf16):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, weight_decay=0.0, bf16=bf16),
    )
    before = params(trainer.model)
    trainer.train()
    after = params(trainer.model)
    assert [n for n in before if torch.equal(before[n], after[n])] == []
    assert trainer.state.global_step == 1
    row = trainer.state.log_history[-1]
    assert row["grad_norm"] > 0 and math.isfinite(row["loss"])


def test_standard_prompts_and_extra_columns_reach_rewards(tiny_model_dir, tmp_path):
    seen = []

    def reward_func(completions, ground_truth, prompts, completion_ids, trainer_state, **kwargs):
        seen.append((list(prompts), list(ground_truth), completions, completion_ids, trainer_state.global_step))
        matches = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
        contents = [m.group(1) if m else "" for m in matches]
        return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]

    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=reward_func, train_dataset=text_dataset(), args=cfg(tmp_path)
    )
    trainer.train()
    prompts, truths, completions, ids, step = seen[0]
    assert len(prompts) == 8 and all(isinstance(c, str) for c in completions)
    for prompt, truth in zip(prompts, truths):  # each row's column value travels with its own prompt
        assert prompt == f"Solve the equation x = {truth}."
    assert prompts[0] == prompts[3] and prompts[4] == prompts[7]  # groups of G=4 consecutive rows
    tok = make_tokenizer()
    assert [tok.decode(i, skip_special_tokens=True) for i in ids] == completions


def test_conversational_completions_are_messages_and_stop_at_end_of_turn(tiny_model_dir, tmp_path):
    seen = {}

    def format_reward_func(completions, **kwargs):
        seen["completions"] = completions
        seen["ids"] = kwargs["completion_ids"]
        pattern = r"^<think>.*?</think><answer>.*?</answer>$"
        return [1.0 if re.match(pattern, c[0]["content"]) else 0.0 for c in completions]

    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=format_reward_func,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, max_completion_length=64),
    )
    trainer.train()
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in seen["completions"])
    im_end = make_tokenizer().convert_tokens_to_ids("<|im_end|>")
    assert im_end in trainer.parts.stop_ids
    for ids in seen["ids"]:  # a completion never runs past a stop token
        assert all(t not in trainer.parts.stop_ids for t in ids[:-1])


def test_multiple_weighted_multitask_and_async_rewards(tiny_model_dir, tmp_path):
    def math_reward(completions, task, **kwargs):
        return [1.0 if t == "math" else None for t in task]

    def format_reward(completions, task, **kwargs):
        return [len(text_of(c)) / 8.0 if t == "format" else None for c, t in zip(completions, task)]

    async def async_reward(completions, **kwargs):
        await asyncio.sleep(0)
        return [0.5] * len(completions)

    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[math_reward, format_reward, async_reward],
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, reward_weights=[2.0, 1.0, 1.0], shuffle_dataset=False),
    )
    trainer.train()
    row = trainer.state.log_history[-1]
    assert row["rewards/math_reward/mean"] == 1.0 and row["rewards/async_reward/mean"] == 0.5
    assert row["rewards/format_reward/mean"] is not None
    # each row: either math (2*1.0 + 0.5) or format (len/8 + 0.5); the mean lies between the two families
    assert 0.5 < row["reward"] < 2.5 + 1e-6


class BoxedAnswers(ScriptedEngine):
    """Sample j of a "Solve i+1" prompt answers \\boxed{i+1} when j is even, \\boxed{0} (never right) when odd."""

    def generate(self, requests):
        ids = []
        for request in requests:
            question = request.prompt.messages[-1]["content"]
            right = str(int(question.split()[-1].split("+")[0]) + 1)
            for j in range(request.num_samples):
                text = "\\boxed{" + (right if j % 2 == 0 else "0") + "}"
                ids.append(self.tok.convert_tokens_to_ids(list(text)) + [self.end])
        return assemble(expand(requests), ids, [[0.0] * len(c) for c in ids], {self.end}, self.tok)


def test_accuracy_reward_quick_start(tiny_model_dir, tmp_path):
    from grpo.rewards import accuracy_reward

    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=accuracy_reward, train_dataset=chat_dataset(), args=cfg(tmp_path)
    )
    trainer.engine = BoxedAnswers(trainer.processing_class)
    trainer.train()
    row = trainer.state.log_history[-1]
    assert row["rewards/accuracy_reward/mean"] == 0.5 and row["frac_reward_zero_std"] == 0.0


def test_reference_model_only_when_beta_positive(tiny_model_dir, tmp_path):
    plain = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=cfg(tmp_path)
    )
    assert plain.ref_model is None
    plain.train()
    assert "kl" not in plain.state.log_history[-1]
    with_kl = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, beta=0.1, max_steps=2),
    )
    assert with_kl.ref_model is not None
    ref_before = params(with_kl.ref_model)
    with_kl.train()
    assert with_kl.state.log_history[-1]["kl"] > 0  # the policy moved away from the frozen reference
    assert all(torch.equal(p, ref_before[n]) for n, p in params(with_kl.ref_model).items())


def test_metrics_file_checkpoints_and_save_model(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    args = cfg(tmp_path, max_steps=4, logging_steps=2, save_strategy="steps", save_steps=2, save_total_limit=1)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    trainer.train()
    out = args.output_dir
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [2, 4]
    for key in (
        "reward",
        "reward_std",
        "rewards/length_reward/mean",
        "rewards/length_reward/std",
        "frac_reward_zero_std",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "completions/mean_terminated_length",
        "entropy",
        "clip_ratio/region_mean",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
        "loss",
        "grad_norm",
        "learning_rate",
        "num_tokens",
        "step_time",
    ):
        assert key in rows[-1], key
    assert rows[-1]["num_tokens"] > rows[0]["num_tokens"]
    # save_total_limit=1 kept the newest; .grpo.lock is the run lock's file; then the run report and its facts
    assert sorted(os.listdir(out)) == [".grpo.lock", "checkpoint-4", "metrics.jsonl", "report.html", "run_info.json"]
    assert os.path.exists(os.path.join(out, "checkpoint-4", "optimizer.pt"))
    trainer.save_model(str(tmp_path / "final"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    for n, p in trainer.unwrapped_model.state_dict().items():
        assert torch.equal(p, reloaded.state_dict()[n])


def test_args_none_model_object_and_processing_class(tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trainer = GRPOTrainer(
        model=model, reward_funcs=length_reward, train_dataset=chat_dataset(), processing_class=make_tokenizer()
    )
    assert trainer.args.output_dir == os.path.abspath("tiny-llama-GRPO")  # resolved once, at construction
    assert trainer.args.learning_rate == 1e-6 and trainer.args.num_generations == 8
    assert trainer.unwrapped_model is model  # the object given is the one trained, not a copy
    assert trainer.processing_class.get_vocab() == make_tokenizer().get_vocab()
    assert trainer.processing_class.padding_side == "left"  # prompts are right-aligned for generation
    assert trainer.state.log_history == []


def test_steps_per_generation_and_iterations_reuse_one_generation(tiny_model_dir, tmp_path):
    calls = []

    def counting_reward(completions, **kwargs):
        calls.append(len(completions))
        return length_reward(completions)

    args = cfg(
        tmp_path,
        per_device_train_batch_size=4,
        steps_per_generation=2,
        num_iterations=2,
        max_steps=4,
        gradient_accumulation_steps=1,
    )
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=counting_reward, train_dataset=chat_dataset(), args=args)
    assert trainer._needs_old_logps()
    seen = []
    original = trainer._loss_and_backward
    trainer._loss_and_backward = lambda batch: seen.append(batch) or original(batch)
    trainer.train()
    # one generation of 8 completions feeds spg * mu = 4 micro-steps = 4 optimizer steps: two slices of 4, each
    # trained on twice, against the old policy's log-probs of the generation
    assert calls == [8] and len(trainer.state.log_history) == 4
    assert seen[0] is seen[2] and seen[1] is seen[3] and seen[0] is not seen[1]
    rows = torch.cat([seen[0].completion_ids, seen[1].completion_ids]).shape[0]
    assert rows == 8 and all(b.old_logps is not None and len(b) == 4 for b in seen)


def test_report_to_tensorboard_writes_events(tiny_model_dir, tmp_path):
    pytest.importorskip("tensorboardX")
    args = cfg(tmp_path, max_steps=2, report_to="tensorboard", run_name="tb-run")
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    trainer.train()
    events = [
        os.path.join(root, f)
        for root, _, files in os.walk(args.output_dir)
        for f in files
        if f.startswith("events.out.tfevents")
    ]
    assert events
    content = b"".join(open(e, "rb").read() for e in events)
    assert b"completions/mean_length" in content and b"grad_norm" in content  # the scalars' tags
