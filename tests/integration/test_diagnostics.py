"""Each diagnostic on a metrics history made to trigger it and on one made not to; the trainer warns once."""

from __future__ import annotations

import logging
import math

import pytest

from grpo import GRPOConfig, GRPOTrainer
from grpo.observe import diagnostics
from support.runs import cfg, chat_dataset

LIMITS = diagnostics.Limits.of(GRPOConfig(output_dir="/tmp/unused-diagnostics"))


def history(n=6, **series):
    """n training rows with a healthy baseline; `series` gives per-row values (a list) for some keys."""
    rows = []
    for i in range(n):
        row = {
            "step": i + 1,
            "loss": 0.1,
            "reward": 0.5,
            "frac_reward_zero_std": 0.1,
            "completions/clipped_ratio": 0.0,
            "entropy": 1.0,
            "grad_norm": 1.0,
            "rewards/good/std": 0.4,
        }
        for key, values in series.items():
            row[key] = values[i]
        rows.append(row)
    return rows


CASES = {
    "no_reward_spread": (
        dict(frac_reward_zero_std=[0.1, 0.2, 0.3, 0.6, 0.7, 0.9]),
        dict(frac_reward_zero_std=[0.9, 0.9, 0.9, 0.4, 0.9, 0.9]),
    ),  # not 3 in a row at the end
    "truncated": (
        dict(**{"completions/clipped_ratio": [0, 0, 0, 0.5, 0.8, 1.0]}),
        dict(**{"completions/clipped_ratio": [1, 1, 1, 1, 0.4, 1]}),
    ),
    "sampling_mismatch": (
        dict(**{"sampling/importance_sampling_ratio/mean": [1, 1, 1, 1, 1, 1.4]}),
        dict(**{"sampling/importance_sampling_ratio/mean": [1, 1, 1, 1, 1.4, 1.1]}),
    ),
    "entropy_collapse": (
        dict(entropy=[1.0, 0.5, 0.2, 0.1, 0.06, 0.04]),
        dict(entropy=[0.04, 0.04, 0.04, 0.04, 0.04, 0.04]),
    ),  # always low: never collapsed
    "exploding_gradients": (
        dict(grad_norm=[1.0, 1.1, 0.9, 1.0, 1.2, 15.0]),
        dict(grad_norm=[1.0, 1.1, 0.9, 1.0, 1.2, 9.0]),
    ),
    "constant_reward/broken": (
        {"rewards/broken/std": [0.3, 0.2, 0.1, 0.0, 0.0, 0.0]},
        {"rewards/broken/std": [0.0, 0.0, 0.0, 0.0, 0.1, 0.0]},
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_each_diagnostic_fires_on_its_history_and_not_on_the_other(name):
    fires, quiet = CASES[name]
    assert [f.name for f in diagnostics.diagnose(history(**fires), LIMITS)] == [name]
    assert diagnostics.diagnose(history(**quiet), LIMITS) == []
    assert diagnostics.diagnose(history(), LIMITS) == []  # the healthy baseline


def test_the_sampling_cap_and_a_nan_free_history():
    rows = history(**{"sampling/importance_sampling_ratio/max": [1, 1, 1, 1, 1, 3.5]})
    assert [f.name for f in diagnostics.diagnose(rows, LIMITS)] == ["sampling_mismatch"]
    rows = history(grad_norm=[1, 1, 1, 1, 1, math.nan])  # an fp16-skipped step is not an explosion
    assert diagnostics.diagnose(rows, LIMITS) == []


def with_evals(train_rewards, eval_rewards):
    rows = []
    for i, (r, e) in enumerate(zip(train_rewards, eval_rewards)):
        rows.append({"step": i + 1, "loss": 0.1, "reward": r, "entropy": 1.0, "grad_norm": 1.0})
        rows.append({"step": i + 1, "eval_reward": e})
    return rows


def test_reward_rising_while_the_evaluation_falls():
    fires = with_evals([0.2, 0.5, 0.8], [0.6, 0.5, 0.3])
    assert [f.name for f in diagnostics.diagnose(fires, LIMITS)] == ["reward_up_eval_down"]
    assert diagnostics.diagnose(with_evals([0.2, 0.5, 0.8], [0.3, 0.5, 0.6]), LIMITS) == []  # both rise
    assert diagnostics.diagnose(with_evals([0.5, 0.5, 0.5], [0.6, 0.5, 0.3]), LIMITS) == []  # reward flat


def test_the_trainer_warns_once_when_a_diagnostic_first_fires(tiny_model_dir, tmp_path, caplog):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=lambda completions, **kw: [1.0] * len(completions),  # constant: no spread, no signal
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, max_steps=5),
    )
    with caplog.at_level(logging.WARNING, logger="grpo"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "no reward spread" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("Step 3: 100% of groups have no reward spread")
    assert any("returned the same value (1) for every sample" in r.getMessage() for r in caplog.records)
