"""The report's charts: each a metric family against the optimizer step, drawn with matplotlib (its object API,
no pyplot: no global state, no display) into a PNG embedded in the page, so the page needs nothing else to open.

A chart is drawn only when its metrics were logged (KL only with beta > 0, the sampling ratios only when the
sampler's log-probs are known, tool calls only for tool runs, evaluation only with an eval dataset). A value that
is missing or not finite at a step leaves a gap.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Line:
    key: str
    label: str
    band: str | None = None  # the key of a spread drawn as +/- around the line
    dashed: bool = False


@dataclass(frozen=True)
class Chart:
    title: str
    lines: tuple[Line, ...]
    ylabel: str = ""
    note: str = ""  # one sentence under the chart: what to read in it
    log_scale: bool = False
    unit_interval: bool = False  # a fraction: the axis spans [0, 1]
    keys: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(line.key for line in self.lines))


def _lines(*specs: tuple) -> tuple[Line, ...]:
    return tuple(Line(*spec) for spec in specs)


def reward_names(rows: Sequence[dict]) -> list[str]:
    """The reward functions logged (rewards/<name>/mean), in the order first seen."""
    names: dict[str, None] = {}
    for row in rows:
        for key in row:
            if key.startswith("rewards/") and key.endswith("/mean"):
                names[key[len("rewards/") : -len("/mean")]] = None
    return list(names)


def charts(rows: Sequence[dict]) -> list[Chart]:
    """The charts the logged rows can fill, in the report's order."""
    names = reward_names(rows)
    evals = ["eval_reward"] + sorted({k for row in rows for k in row if k.startswith("eval_pass@")})
    every = [
        Chart(
            "Reward",
            _lines(("reward", "total (weighted sum)", "reward_std"), ("eval_reward", "held-out eval", None, True)),
            note="Mean reward per completion, with its spread (+/- std) across the batch.",
        ),
        Chart(
            "Reward per function",
            tuple(Line(f"rewards/{n}/mean", n, f"rewards/{n}/std") for n in names) if len(names) > 1 else (),
            note="Each reward function's mean (unweighted), +/- its std.",
        ),
        Chart(
            "Groups with no reward spread",
            _lines(("frac_reward_zero_std", "fraction of groups")),
            unit_interval=True,
            note="Groups whose completions all scored the same: their advantage is 0, they teach nothing.",
        ),
        Chart(
            "Completion length",
            _lines(
                ("completions/mean_length", "mean"),
                ("completions/min_length", "min", None, True),
                ("completions/max_length", "max", None, True),
            ),
            ylabel="tokens",
        ),
        Chart(
            "Truncated completions",
            _lines(("completions/clipped_ratio", "fraction truncated")),
            unit_interval=True,
            note="Completions that hit max_completion_length before ending.",
        ),
        Chart("KL to the reference model", _lines(("kl", "KL")), note="Logged when beta > 0."),
        Chart("Entropy", _lines(("entropy", "mean token entropy")), ylabel="nats / token"),
        Chart(
            "Clip ratios",
            _lines(
                ("clip_ratio/region_mean", "clipped (either side)"),
                ("clip_ratio/low_mean", "below 1 - epsilon", None, True),
                ("clip_ratio/high_mean", "above 1 + epsilon_high", None, True),
            ),
            unit_interval=True,
            note="Fraction of tokens whose policy ratio the clipped objective cut.",
        ),
        Chart(
            "Sampling mismatch",
            _lines(
                ("sampling/sampling_logp_difference/mean", "mean |log p_train - log p_sampler|"),
                ("sampling/sampling_logp_difference/max", "max", None, True),
            ),
            log_scale=True,
            note="How far the trained policy's log-probs are from the sampler's, per generated token.",
        ),
        Chart(
            "Importance-sampling ratio",
            _lines(
                ("sampling/importance_sampling_ratio/mean", "mean"),
                ("sampling/importance_sampling_ratio/min", "min", None, True),
                ("sampling/importance_sampling_ratio/max", "max", None, True),
            ),
            note="p_train / p_sampler per token: 1 when the sampler has the trained weights.",
        ),
        Chart(
            "Tool calls",
            _lines(("tools/call_frequency", "calls per completion"), ("tools/failure_frequency", "failed fraction")),
        ),
        Chart("Gradient norm", _lines(("grad_norm", "before clipping")), log_scale=True),
        Chart("Learning rate", _lines(("learning_rate", "learning rate"))),
        Chart(
            "Where the time goes",
            _lines(
                ("step_time", "optimizer step"),
                ("timing/generation_s", "generation"),
                ("timing/scoring_s", "scoring (rewards)"),
            ),
            ylabel="seconds",
            note="Seconds per optimizer step, and per generation batch for generating and scoring it.",
        ),
        Chart(
            "Throughput",
            _lines(("timing/generation_tokens_per_s", "generation"), ("timing/training_tokens_per_s", "training")),
            ylabel="tokens / s",
        ),
        Chart("Evaluation", tuple(Line(k, k[len("eval_") :]) for k in evals), note="On the eval dataset."),
    ]
    return [chart for chart in every if any(_points(rows, key) for key in chart.keys)]


def _points(rows: Sequence[dict], key: str) -> list[tuple[int, float]]:
    return [
        (row["step"], float(row[key]))
        for row in rows
        if isinstance(row.get(key), (int, float)) and not isinstance(row[key], bool) and math.isfinite(row[key])
    ]


def render(chart: Chart, rows: Sequence[dict]) -> str:
    """The chart as a PNG data URI."""
    from matplotlib.figure import Figure  # imported at the first chart: `import grpo` stays quick
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(5.4, 2.9), dpi=110)
    figure.subplots_adjust(left=0.14, right=0.98, top=0.92, bottom=0.16)  # fixed: a layout engine draws twice
    axes = figure.add_subplot()
    for n, line in enumerate(chart.lines):
        points = _points(rows, line.key)
        if not points:
            continue
        steps, values = zip(*points)
        color = f"C{n}"
        style = dict(linestyle="--", linewidth=1.0) if line.dashed else dict(linewidth=1.8)
        marker = "o" if len(points) <= 30 else None
        axes.plot(steps, values, color=color, label=line.label, marker=marker, markersize=3, **style)
        spread = dict(_points(rows, line.band)) if line.band else {}
        if spread:
            band = [(s, v, spread[s]) for s, v in points if s in spread]
            axes.fill_between(
                [s for s, _, _ in band],
                [v - d for _, v, d in band],
                [v + d for _, v, d in band],
                color=color,
                alpha=0.15,
                linewidth=0,
            )
    if chart.log_scale and all(v > 0 for key in chart.keys for _, v in _points(rows, key)):
        axes.set_yscale("log")
    else:
        axes.ticklabel_format(axis="y", useOffset=False)  # 1.0002, not "1e-4 + 1"
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    if chart.unit_interval:
        axes.set_ylim(-0.03, 1.03)
    axes.set_xlabel("step")
    if chart.ylabel:
        axes.set_ylabel(chart.ylabel)
    axes.grid(alpha=0.3)
    axes.spines[["top", "right"]].set_visible(False)
    if len(axes.get_lines()) > 1 or chart.lines[0].label != chart.title.lower():
        axes.legend(fontsize=7, frameon=False, loc="best")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def data_points(chart: Chart, rows: Sequence[dict]) -> int:
    """How many values the chart draws (the page states it, a test checks it)."""
    return sum(len(_points(rows, key)) for key in chart.keys)


def first_and_last(rows: Sequence[dict], key: str) -> tuple[Any, Any]:
    points = _points(rows, key)
    return (points[0][1], points[-1][1]) if points else (None, None)
