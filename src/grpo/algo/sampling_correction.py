"""Sampling-mismatch importance sampling (shared spec §4.2) and the off-policy sequence mask (§4.3), as pure
functions of tensors.

The engine that samples a completion (vLLM, or anything that returns its tokens' log-probs) is not exactly the
policy the trainer optimizes: kernels, precision and logit processing differ. With s_t the engine's log-prob of
the sampled token and old_t the trainer's, recomputed at generation time,

    d_t = nan_to_num((old_t - s_t) * m_t, nan=0)        (a NaN s_t, a token the engine did not score: ratio 1)

    token_truncate     rho_t = clamp(exp d_t, C_min, C_max)                     (B, T)
    token_mask         rho_t = exp d_t if C_min <= exp d_t <= C_max, else 0     (B, T)
    sequence_truncate  rho_i = clamp(exp sum_t d_t, C_min, C_max)               (B, 1)
    sequence_mask      rho_i = exp sum_t d_t if inside [C_min, C_max], else 0   (B, 1)

with a missing bound unbounded. The sequence ratio is the product of token ratios (a sum of logs, not a mean),
and in-range ratios keep their value. rho is a constant: `policy_loss(..., is_ratio=rho)` multiplies the policy
term by it, after the off-policy sequence mask and the entropy mask and before `+ beta * kl` (vespo instead
folds log rho into its sequence weight), as TRL 1.16 does.

The off-policy sequence mask (OPSM, DeepSeek-V3.2, arXiv:2512.02556) drops a row whose advantage is negative
when the sampler's log-probs q have drifted from the current policy by more than a threshold delta:

    kl_i = sum_t m_t nan_to_num(q_t - sg(logp_t), 0) / max(sum_t m_t, 1);   keep iff A_i >= 0 or kl_i <= delta

It is defined in `grpo.algo.losses` (math modules import torch only, and `policy_loss` applies it) and re-exported
here.

Metrics (`sampling_stats`) are `Stat`s, reduced exactly over processes: the means are global sums over counts,
where TRL 1.16 averages each process's mean (and reports 0 for a process without tokens); an empty min or max
is NaN, which the reduction skips, where 1.16 reports 0 (so its min over processes can read 0). grpo adds
`sampling/importance_sampling_ratio/clipped_fraction`, the fraction of ratios that fell outside the bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from grpo.algo.losses import Stat, _nan_extreme, masked_mean_stat, off_policy_mask
from grpo.config import ResolvedConfig
from grpo.config.grpo_fields import IS_MODES

__all__ = ["MODES", "SamplingCorrection", "off_policy_mask", "sampling_ratio", "sampling_stats"]

MODES = IS_MODES  # the config's list of vllm_importance_sampling_mode values


@torch.no_grad()
def sampling_ratio(
    trainer_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The importance weight rho = pi_trainer / pi_sampler of `mode`, and which ratios fell outside
    [clip_min, clip_max] before truncation or masking (bool, same shape as rho: (B, T), or (B, 1) per sequence).

    trainer_logps, sampling_logps: (B, T) log-probs of the sampled tokens; mask: (B, T), nonzero on trained tokens.
    """
    if mode not in MODES:
        raise ValueError(f"Unknown importance sampling mode {mode!r}; expected one of {', '.join(MODES)}.")
    diff = torch.nan_to_num((trainer_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    outside = (ratio < low) | (ratio > high)
    if mode.endswith("_mask"):
        return ratio.masked_fill(outside, 0.0), outside
    if clip_min is None and clip_max is None:  # nothing to truncate (torch.clamp refuses two Nones: 1.16 stops here)
        return ratio, outside
    return ratio.clamp(min=clip_min, max=clip_max), outside


def _mean(values: torch.Tensor) -> Stat:
    return Stat("mean", torch.stack([values.sum(), values.new_tensor(float(values.numel()))]).float())


@torch.no_grad()
def sampling_stats(
    trainer_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    rho: torch.Tensor,
    outside: torch.Tensor,
) -> dict[str, Stat]:
    """The sampling/* metrics of one process's batch (rho and outside as `sampling_ratio` returns them).

    The log-prob difference is taken over active tokens the engine scored (non-NaN); the ratio statistics over
    active tokens in the token modes, over every row in the sequence modes (as 1.16).
    """
    active = mask > 0
    diff = (trainer_logps - sampling_logps).abs().float()
    diff = diff[active & ~torch.isnan(diff)]
    per_row = rho.shape != mask.shape  # a sequence mode (with T = 1 the two read the same; taken as token)
    ratios = rho.flatten() if per_row else rho[active]
    flagged = outside.flatten() if per_row else outside[active]
    ratios = ratios.float()
    return {
        "sampling/sampling_logp_difference/mean": _mean(diff),
        "sampling/sampling_logp_difference/max": _nan_extreme(diff, "max"),
        "sampling/importance_sampling_ratio/min": _nan_extreme(ratios, "min"),
        "sampling/importance_sampling_ratio/mean": _mean(ratios),
        "sampling/importance_sampling_ratio/max": _nan_extreme(ratios, "max"),
        "sampling/importance_sampling_ratio/clipped_fraction": _mean(flagged.float()),
    }


@dataclass(frozen=True)
class SamplingCorrection:
    """How one micro-step uses the sampler's log-probs, from the config and the engine.

    The trainer's log-probs are the old policy's when the batch is reused after an update, else the training
    pass's own, detached: on-policy they are what a separate no-grad pass would compute, so no extra forward
    runs (TRL 1.16 runs one with vLLM). The sampling/* metrics are computed for every engine; the weight rho
    multiplies the loss, and OPSM compares with the sampler's log-probs, only for an engine that samples from a
    copy of the policy (`external`: vLLM), as 1.16."""

    mode: str = "sequence_mask"
    clip_min: float | None = None
    clip_max: float | None = 3.0
    external: bool = False
    apply: bool = False

    @classmethod
    def of(cls, args: ResolvedConfig, engine: Any) -> SamplingCorrection:
        external = bool(getattr(engine, "samples_elsewhere", False))
        return cls(
            mode=args.vllm_importance_sampling_mode,
            clip_min=args.vllm_importance_sampling_clip_min,
            clip_max=args.vllm_importance_sampling_clip_max,
            external=external,
            apply=external and args.vllm_importance_sampling_correction,
        )

    def __call__(
        self,
        logps: torch.Tensor,
        old_logps: torch.Tensor | None,
        sampling_logps: torch.Tensor,
        mask: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, Stat]]:
        """(is_ratio for `policy_loss` or None, sampler_logps for OPSM or None, the sampling/* metrics)."""
        trainer = (old_logps if old_logps is not None else logps).detach()
        rho, outside = sampling_ratio(trainer, sampling_logps, mask, self.mode, self.clip_min, self.clip_max)
        stats = sampling_stats(trainer, sampling_logps, mask, rho, outside)
        return (rho if self.apply else None), (sampling_logps if self.external else None), stats


def importance_stats(logps: torch.Tensor, old: torch.Tensor | None, mask: torch.Tensor) -> dict[str, Stat]:
    """Async generation's importance weight exp(logp - old) against the behaviour policy that sampled (old: the
    producer's log-probs, `grpo.rounds.asynchronous`) over trained tokens: its mean and max."""
    if old is None:
        return {}
    weights = torch.exp(logps.float() - old.float())
    top = weights[mask.bool()].max() if mask.any() else weights.new_tensor(float("nan"))
    return {
        "sample/importance_weight_mean": masked_mean_stat(weights, mask),
        "sample/importance_weight_max": Stat("max", top),
    }
