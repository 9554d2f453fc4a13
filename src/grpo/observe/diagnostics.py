"""Diagnostics: what the logged metrics say is going wrong in a run, in words, with what to try.

Each check is a pure function of the logged rows (`trainer.state.log_history`: training rows and evaluation rows)
and the few settings it compares them with (`Limits`), and returns a `Finding` or None. The trainer runs them at
every logging step and prints a finding as one warning line the first time it appears; the run report
(`grpo.observe.report`) states them at its top.
Each check's threshold is in `THRESHOLDS` (stated in the report and in docs/report.md too).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grpo.config import GRPOConfig

logger = logging.getLogger("grpo")
WINDOW = 3  # logged rows a persistent condition must hold for

# each diagnostic and when it fires (the report lists them)
THRESHOLDS = (
    ("no reward spread", f"frac_reward_zero_std >= 0.5 in each of the last {WINDOW} logged rows"),
    ("truncated completions", f"completions/clipped_ratio >= 0.5 in each of the last {WINDOW} logged rows"),
    (
        "sampling mismatch",
        "in the latest row, sampling/importance_sampling_ratio/mean outside [1 - epsilon, 1 + epsilon_high], or its "
        "max above vllm_importance_sampling_clip_max",
    ),
    ("entropy collapse", "entropy below 0.05 nats per token and below a fifth of the first logged value"),
    (
        "reward up, evaluation down",
        f"over the last {WINDOW} evaluations eval_reward fell by more than 0.05 while the training reward rose by "
        "more than 0.05",
    ),
    ("constant reward function", f"rewards/<name>/std is 0 in each of the last {WINDOW} logged rows"),
    ("exploding gradient norm", "the latest finite grad_norm is over 10x the median of the earlier ones (5 or more)"),
)


@dataclass(frozen=True)
class Finding:
    name: str  # one per diagnostic (and reward function)
    step: int
    message: str


@dataclass(frozen=True)
class Limits:
    """The run's settings the checks compare the logged metrics with (the config's fields of the same names)."""

    max_completion_length: int | None
    epsilon: float
    epsilon_high: float | None  # None: epsilon
    vllm_importance_sampling_clip_max: float | None

    @classmethod
    def of(cls, config: GRPOConfig) -> Limits:
        return cls(
            config.max_completion_length,
            config.epsilon,
            config.epsilon_high,
            config.vllm_importance_sampling_clip_max,
        )

    @classmethod
    def saved(cls, values: Mapping[str, Any]) -> Limits:
        """From a saved configuration's values (run_info.json's, over the defaults: `grpo report`)."""
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})


def _training_rows(rows: Sequence[dict]) -> list[dict]:
    return [r for r in rows if "loss" in r or "reward" in r]


def _values(rows: Sequence[dict], key: str) -> list[float]:
    return [number for r in rows if (number := _float(r.get(key))) is not None]


def _float(value: Any) -> float | None:
    """A logged number as a finite float, else None (a JSON integer of 400 digits has no float)."""
    if not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _persistent(rows: Sequence[dict], key: str, holds: Callable[[float], bool]) -> float | None:
    """The latest value of `key` when it held in each of the last WINDOW training rows that logged it."""
    values = _values(_training_rows(rows), key)[-WINDOW:]
    return values[-1] if len(values) == WINDOW and all(holds(v) for v in values) else None


def no_reward_spread(rows: Sequence[dict], limits: Limits) -> Finding | None:
    value = _persistent(rows, "frac_reward_zero_std", lambda v: v >= 0.5)
    if value is None:
        return None
    return Finding(
        "no_reward_spread",
        rows[-1]["step"],
        f"{value:.0%} of groups have no reward spread (all their completions scored the same), so their advantage "
        f"is 0 and they teach nothing (mean reward {_g(_latest(rows, 'reward'))}: if that is the best score, most "
        "prompts are solved and harder ones would teach more). Try dynamic_sampling=True, more num_generations, a "
        "higher temperature, or a reward with partial credit.",
    )


def _latest(rows: Sequence[dict], key: str) -> float | None:
    values = _values(_training_rows(rows), key)
    return values[-1] if values else None


def truncated(rows: Sequence[dict], limits: Limits) -> Finding | None:
    value = _persistent(rows, "completions/clipped_ratio", lambda v: v >= 0.5)
    if value is None:
        return None
    return Finding(
        "truncated",
        rows[-1]["step"],
        f"{value:.0%} of completions hit max_completion_length ({limits.max_completion_length}) before ending: raise "
        "max_completion_length, or set mask_truncated_completions=True to leave them out of the loss.",
    )


def sampling_mismatch(rows: Sequence[dict], limits: Limits) -> Finding | None:
    latest = _training_rows(rows)[-1:] or [{}]
    mean = latest[0].get("sampling/importance_sampling_ratio/mean")
    peak = latest[0].get("sampling/importance_sampling_ratio/max")
    low, high = 1 - limits.epsilon, 1 + (limits.epsilon_high if limits.epsilon_high is not None else limits.epsilon)
    cap = limits.vllm_importance_sampling_clip_max
    off = isinstance(mean, (int, float)) and not low <= mean <= high
    spiky = isinstance(peak, (int, float)) and cap is not None and peak > cap
    if not (off or spiky):
        return None
    return Finding(
        "sampling_mismatch",
        rows[-1]["step"],
        f"The sampler and the trained policy disagree: importance ratio mean {_g(mean)}, max {_g(peak)} (clip range "
        f"[{low:g}, {high:g}], cap {cap}). The engine may sample from stale or differently rounded weights: check "
        "the weight sync, run generation in the training precision, or keep vllm_importance_sampling_correction on.",
    )


def entropy_collapse(rows: Sequence[dict], limits: Limits) -> Finding | None:
    values = _values(_training_rows(rows), "entropy")
    if len(values) < 2 or not (values[-1] < 0.05 and values[-1] < values[0] / 5):
        return None
    return Finding(
        "entropy_collapse",
        rows[-1]["step"],
        f"Entropy collapsed from {values[0]:.3g} to {values[-1]:.3g} nats per token: the policy has become nearly "
        "deterministic and GRPO's groups will stop differing. Lower learning_rate, raise temperature, or use "
        "entropy_coef / use_adaptive_entropy.",
    )


def reward_up_eval_down(rows: Sequence[dict], limits: Limits) -> Finding | None:
    evals = [r for r in rows if isinstance(r.get("eval_reward"), (int, float))][-WINDOW:]
    if len(evals) < WINDOW:
        return None
    train = _training_rows(rows)

    def reward_near(step: int) -> float | None:
        before = [r["reward"] for r in train if r.get("step", 0) <= step and isinstance(r.get("reward"), (int, float))]
        return before[-1] if before else None

    first, last = reward_near(evals[0]["step"]), reward_near(evals[-1]["step"])
    fell = evals[0]["eval_reward"] - evals[-1]["eval_reward"]
    if first is None or last is None or not (fell > 0.05 and last - first > 0.05):
        return None
    return Finding(
        "reward_up_eval_down",
        rows[-1]["step"],
        f"The training reward rose ({first:.3g} -> {last:.3g}) while the held-out eval_reward fell "
        f"({evals[0]['eval_reward']:.3g} -> {evals[-1]['eval_reward']:.3g}): the policy may be exploiting the reward "
        "(reward hacking) or overfitting the training prompts. Inspect completions (log_completions=True).",
    )


def constant_rewards(rows: Sequence[dict], limits: Limits) -> list[Finding]:
    train = _training_rows(rows)
    names = sorted(
        {
            k[len("rewards/") : -len("/std")]
            for r in train[-1:]
            for k in r
            if k.startswith("rewards/") and k.endswith("/std")
        }
    )
    found = []
    for name in names:
        if _persistent(rows, f"rewards/{name}/std", lambda v: v == 0.0) is not None:
            found.append(
                Finding(
                    f"constant_reward/{name}",
                    rows[-1]["step"],
                    f"Reward function '{name}' returned the same value ({_g(_latest(rows, f'rewards/{name}/mean'))}) "
                    f"for every sample in the last {WINDOW} logged steps: it gives no learning signal. If that is its "
                    "best score the task is learned (stop, or give harder prompts); otherwise check that it reads the "
                    "completion it is given.",
                )
            )
    return found


def exploding_gradients(rows: Sequence[dict], limits: Limits) -> Finding | None:
    norms = _values(_training_rows(rows), "grad_norm")
    if len(norms) < 6:
        return None
    median = statistics.median(norms[:-1])
    if median <= 0 or norms[-1] <= 10 * median:
        return None
    return Finding(
        "exploding_gradients",
        rows[-1]["step"],
        f"grad_norm {norms[-1]:.3g} is {norms[-1] / median:.0f}x its median so far ({median:.3g}): training may be "
        "diverging. Lower learning_rate or max_grad_norm, or check for a reward with extreme values.",
    )


def _g(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) else "not logged"


CHECKS = (no_reward_spread, truncated, sampling_mismatch, entropy_collapse, reward_up_eval_down, exploding_gradients)


def diagnose(rows: Sequence[dict], limits: Limits) -> list[Finding]:
    """Every diagnostic that fires on the logged rows."""
    if not rows:
        return []
    found = [f for check in CHECKS if (f := check(rows, limits)) is not None]
    return found + constant_rewards(rows, limits)


class Diagnosis:
    """The run's findings; `update` warns once per diagnostic, the first time it fires."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.seen: dict[str, Finding] = {}

    def update(self, rows: Sequence[dict], is_main_process: bool = True, quiet: bool = False) -> list:
        new = [f for f in diagnose(rows, self.limits) if f.name not in self.seen]
        for finding in new:
            self.seen[finding.name] = finding
            if is_main_process and not quiet:
                logger.warning("Step %d: %s", finding.step, finding.message)
        return new

    def replay(self, rows: Sequence[dict]) -> Diagnosis:
        """Find, without warning, what the checks found as the rows were logged one by one (a resumed run's
        earlier findings, a report rebuilt from metrics.jsonl): each finding at the step it first appeared."""
        for end in range(1, len(rows) + 1):
            self.update(rows[:end], quiet=True)
        return self

    @property
    def findings(self) -> list[Finding]:
        return sorted(self.seen.values(), key=lambda f: f.step)
