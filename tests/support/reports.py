"""Recorded runs for the report's tests: a training history with every metric family the report charts
(`full_history`), a run directory written from rows (`write_run`), and the charts a page draws (`charts_in`)."""

from __future__ import annotations

import json
import os
import re

import pandas as pd


def full_history(n=8):
    """Training rows with every metric family the report charts (two reward functions, tools, sampling ratios),
    most groups without reward spread from step 4 on, and an evaluation every 4 steps."""
    rows = []
    for i in range(1, n + 1):
        row = {
            "step": i,
            "epoch": i / n,
            "reward": 0.1 * i,
            "reward_std": 0.2,
            "rewards/correct/mean": 0.05 * i,
            "rewards/correct/std": 0.1,
            "rewards/format/mean": 0.5,
            "rewards/format/std": 0.3,
            "frac_reward_zero_std": 0.8 if i >= 4 else 0.1,
            "completions/mean_length": 20.0 + i,
            "completions/min_length": 5.0,
            "completions/max_length": 32.0,
            "completions/clipped_ratio": 0.1,
            "kl": 0.01 * i,
            "entropy": 1.0 - 0.05 * i,
            "clip_ratio/region_mean": 0.02,
            "clip_ratio/low_mean": 0.01,
            "clip_ratio/high_mean": 0.01,
            "sampling/sampling_logp_difference/mean": 1e-3,
            "sampling/sampling_logp_difference/max": 1e-2,
            "sampling/importance_sampling_ratio/mean": 1.0,
            "sampling/importance_sampling_ratio/min": 0.9,
            "sampling/importance_sampling_ratio/max": 1.1,
            "tools/call_frequency": 0.5,
            "tools/failure_frequency": 0.1,
            "grad_norm": 1.0,
            "learning_rate": 1e-5 * (1 - i / n),
            "step_time": 2.0,
            "timing/generation_s": 1.5,
            "timing/scoring_s": 0.1,
            "timing/generation_tokens_per_s": 300.0,
            "timing/training_tokens_per_s": 900.0,
            "loss": 0.01,
            "num_tokens": 100 * i,
        }
        rows.append(row)
        if i % 4 == 0:
            rows.append({"step": i, "epoch": i / n, "eval_reward": 0.3, "eval_pass@4": 0.5})
    return rows


def write_run(directory, rows, completions=None, info=None):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    for step, table in (completions or {}).items():
        os.makedirs(os.path.join(directory, "completions"), exist_ok=True)
        pd.DataFrame([{"step": step, **r} for r in table]).to_parquet(
            os.path.join(directory, "completions", f"completions_{step:05d}.parquet"), index=False
        )
    if info is not None:
        with open(os.path.join(directory, "run_info.json"), "w") as f:
            f.write(info if isinstance(info, str) else json.dumps(info))
    return str(directory)


def charts_in(page):
    """{chart title: points drawn} of a report page."""
    return {t: int(n) for t, n in re.findall(r'data-chart="([^"]+)" data-points="(\d+)"', page)}
