"""trainer.evaluate() and evaluation during training: the eval_ metrics (pass@k included), parameters untouched,
and a run with evaluations ending bit-identical to the same run without them, and resuming as exactly."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from support.rewards import length_reward, text_of
from support.runs import cfg, chat_dataset, weights
from support.scripted import ScriptedEngine


def trainer_for(model_dir, tmp_path, eval_dataset=None, reward=length_reward, **kw):
    from grpo import GRPOTrainer

    return GRPOTrainer(
        model=model_dir,
        reward_funcs=reward,
        train_dataset=chat_dataset(),
        eval_dataset=eval_dataset if eval_dataset is not None else chat_dataset(4),
        args=cfg(tmp_path, **kw),
    )


def test_evaluate_returns_the_eval_metrics_and_moves_nothing(tiny_model_dir, tmp_path):
    def long_enough(completions, **kw):  # passes (1.0) when the completion has at least 5 letters
        return [1.0 if len(text_of(c)) >= 5 else 0.0 for c in completions]

    trainer = trainer_for(tiny_model_dir, tmp_path, reward=long_enough, per_device_eval_batch_size=4)
    trainer.engine = ScriptedEngine(trainer.processing_class)
    before = weights(trainer)
    metrics = trainer.evaluate()
    assert all(torch.equal(p, before[n]) for n, p in weights(trainer).items())
    # ScriptedEngine: sample j of a prompt has 1 + (sum(ids) + 3j) % 8 letters; count them per prompt here
    lengths, passed = [], []
    for i in range(4):
        ids = trainer.parts.evaluations[None].source[i].ids
        group = [1 + (sum(ids) + 3 * j) % 8 for j in range(4)]
        lengths += group
        passed.append(any(n >= 5 for n in group))
    rewards = [1.0 if n >= 5 else 0.0 for n in lengths]
    assert metrics["eval_reward"] == pytest.approx(sum(rewards) / 16)
    assert metrics["eval_rewards/long_enough/mean"] == pytest.approx(sum(rewards) / 16)
    assert metrics["eval_pass@4"] == pytest.approx(sum(passed) / 4)
    model_tokens = [n + (n < 8) for n in lengths]  # the end-of-turn token unless 8 letters (truncated)
    assert metrics["eval_completions/mean_length"] == pytest.approx(sum(model_tokens) / 16)
    assert metrics["eval_completions/clipped_ratio"] == pytest.approx(sum(n == 8 for n in lengths) / 16)
    assert trainer.state.log_history[-1]["eval_reward"] == metrics["eval_reward"]


def test_a_run_with_evaluations_ends_like_one_without_and_resumes_exactly(tiny_model_dir, tmp_path):
    """The fast engine samples with torch's generator: evaluation must give it back as it found it."""
    plain = trainer_for(tiny_model_dir, tmp_path / "plain", max_steps=4)
    plain.train()
    kw = dict(max_steps=4, eval_strategy="steps", eval_steps=1, eval_on_start=True, save_strategy="steps", save_steps=2)
    evaluated = trainer_for(tiny_model_dir, tmp_path / "eval", **kw)
    evaluated.train()
    steps = [row["step"] for row in evaluated.state.log_history if "eval_reward" in row]
    assert steps == [0, 1, 2, 3, 4]
    final = weights(evaluated)
    assert all(torch.equal(p, final[n]) for n, p in weights(plain).items())
    resumed = trainer_for(tiny_model_dir, tmp_path / "resumed", **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "eval" / "out" / "checkpoint-2"))
    assert all(torch.equal(p, final[n]) for n, p in weights(resumed).items())


def test_greedy_evaluation_and_several_eval_datasets(tiny_model_dir, tmp_path):
    def runs(trainer):
        out = []
        for seed in (1, 2):  # different generator states: sampled completions differ, greedy ones do not
            torch.manual_seed(seed)
            out.append({k: v for k, v in trainer.evaluate().items() if "runtime" not in k})
        return out

    datasets = {"a": chat_dataset(2), "b": chat_dataset(3)}
    greedy = trainer_for(tiny_model_dir, tmp_path / "g", eval_dataset=datasets, eval_greedy=True)
    first, second = runs(greedy)
    assert "eval_a_pass@1" in first and "eval_b_reward" in first and "eval_reward" not in first
    assert first == second
    sampled = trainer_for(tiny_model_dir, tmp_path / "s", eval_dataset=datasets)
    first, second = runs(sampled)
    assert "eval_a_pass@4" in first and first != second


def test_evaluation_errors(tiny_model_dir, tmp_path):
    from grpo import GRPOTrainer

    with pytest.raises(ValueError, match="eval_strategy='steps'.*no eval_dataset"):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path, eval_strategy="steps"),
        )
    with pytest.raises(
        ValueError, match="per_device_eval_batch_size \\(6\\) x 1 process.*num_generations_eval \\(4\\)"
    ):
        trainer_for(tiny_model_dir, tmp_path, per_device_eval_batch_size=6)
    with pytest.raises(ValueError, match="eval_dataset has no 'prompt'|no 'prompt' column"):
        trainer_for(tiny_model_dir, tmp_path, eval_dataset=Dataset.from_list([{"q": "x"}]))
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=cfg(tmp_path)
    )
    with pytest.raises(ValueError, match="evaluate\\(\\) needs an eval_dataset"):
        trainer.evaluate()
