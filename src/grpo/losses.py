"""Policy losses of GRPO and its descendants, as pure functions of tensors.

Call `policy_loss(logps, old_logps, advantages, mask, args)` to get one process's loss for one micro-batch and
its metrics. The math follows the shared spec §2 (TRL 1.16):

1. importance weight `r = exp(log w)`, with `log w = logp - old` per token, or its masked mean per sequence
   (`importance_sampling_level="sequence"`, GSPO);
2. a per-token objective chosen by `loss_type` from `PER_TOKEN_LOSSES` (one function per paper);
3. multiplicative masks (the entropy mask), then `+ beta * kl` (k3 estimator), so the KL term is not masked
   by them;
4. aggregation chosen by `loss_type` from `AGGREGATIONS`.

Gradient accumulation, process count and steps_per_generation are the caller's business: for the
token-sum losses (`TOKEN_SUM_LOSSES`) the caller passes the normalizer as `num_items_in_batch`; every other
loss type is divided by the number of accumulation steps by the caller.

Metrics are returned as sufficient statistics (`Stat`) so a distributed caller can reduce them exactly
(global masked means, not means of means); `policy_loss` turns them into floats for one process.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

TOKEN_SUM_LOSSES = frozenset({"dapo", "cispo", "vespo"})
CLIPPED_LOSSES = frozenset({"grpo", "bnpo", "dr_grpo", "dapo", "luspo"})


@dataclass
class Stat:
    """A metric as a reducible statistic: `mean` holds (sum, count); `min`/`max` hold one value (NaN: none)."""

    kind: str
    value: torch.Tensor

    def local(self) -> float:
        if self.kind == "mean":
            return (self.value[0] / self.value[1].clamp(min=1.0)).item()
        return self.value.item()


@dataclass
class PolicyTerms:
    """What every per-token objective may read. Shapes: (B, T), or (B, 1) for sequence-level terms."""

    logps: torch.Tensor  # log pi_theta of the sampled tokens, with gradient
    log_ratio: torch.Tensor  # logp - old, per token (B, T)
    ratio: torch.Tensor  # importance weight r: token (B, T) or sequence (B, 1)
    advantages: torch.Tensor  # (B, 1) or (B, T)
    mask: torch.Tensor  # (B, T) float, 1 on trained tokens


def masked_mean_stat(x: torch.Tensor, mask: torch.Tensor) -> Stat:
    """Masked mean over tokens, or a plain mean over sequences when x is (B, 1)."""
    if x.shape[1] == 1:
        return Stat("mean", torch.stack([x.sum(), x.new_tensor(float(x.shape[0]))]).detach().float())
    return Stat("mean", torch.stack([(x * mask).sum(), mask.sum()]).detach().float())


def _per_sequence(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.shape[1] == 1:
        return x.squeeze(1)
    return (x * mask).sum(-1) / mask.sum(-1)  # NaN for rows without trained tokens: nanmin/nanmax skip them


def _nan_extreme(x: torch.Tensor, kind: str) -> Stat:
    valid = x[~torch.isnan(x)]
    if valid.numel() == 0:
        return Stat(kind, x.new_tensor(float("nan")).detach())
    return Stat(kind, (valid.min() if kind == "min" else valid.max()).detach())


# ---- per-token objectives: (terms, args) -> (per_token_loss, stats) --------------------------------------------


def clipped_surrogate(t: PolicyTerms, args: Any) -> tuple[torch.Tensor, dict[str, Stat]]:
    """PPO-style clipped objective (GRPO, DeepSeekMath arXiv:2402.03300; DAPO's epsilon_high, arXiv:2503.14476;
    INTELLECT-2's delta cap on the unclipped branch, arXiv:2505.07291)."""
    ratio = t.ratio
    clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)
    if args.delta is not None:
        ratio = torch.clamp(ratio, max=args.delta)
    loss = -torch.min(ratio * t.advantages, clipped * t.advantages)
    low = ((ratio < 1 - args.epsilon) & (t.advantages < 0)).float()
    high = ((ratio > 1 + args.epsilon_high) & (t.advantages > 0)).float()
    region = ((low + high) > 0).float()
    stats = {
        "clip_ratio/low_mean": masked_mean_stat(low, t.mask),
        "clip_ratio/high_mean": masked_mean_stat(high, t.mask),
        "clip_ratio/region_mean": masked_mean_stat(region, t.mask),
        "clip_ratio/low_min": _nan_extreme(_per_sequence(low, t.mask), "min"),
        "clip_ratio/high_max": _nan_extreme(_per_sequence(high, t.mask), "max"),
    }
    return loss, stats


def cispo(t: PolicyTerms, args: Any) -> tuple[torch.Tensor, dict[str, Stat]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): REINFORCE weighted by the detached ratio capped at epsilon_high
    (an absolute cap, as the reference implements it)."""
    capped = torch.clamp(t.ratio, max=args.epsilon_high).detach()
    loss = -capped * t.advantages * t.logps
    clipped = ((t.ratio > args.epsilon_high) & (t.advantages > 0)).float()
    return loss, {"cispo_clip_ratio": masked_mean_stat(clipped, t.mask)}


def sapo(t: PolicyTerms, args: Any) -> tuple[torch.Tensor, dict[str, Stat]]:
    """SAPO (arXiv:2511.20347): a sigmoid soft gate instead of a hard clip; gradient weight 1 at r = 1."""
    tau = torch.where(t.advantages > 0, args.sapo_temperature_pos, args.sapo_temperature_neg)
    return -(torch.sigmoid(tau * (t.ratio - 1)) * 4 / tau) * t.advantages, {}


@torch.no_grad()
def vespo_weights(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, args: Any) -> torch.Tensor:
    """VESPO's per-sequence gamma weight phi(W) = W^k e^{lambda (1 - W)}, with W the product of token ratios."""
    floor = math.log(1e-8)
    seq_log_ratio = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    log_w = torch.clamp(seq_log_ratio, floor, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, args.vespo_k_pos, args.vespo_k_neg)
    lam = torch.where(nonneg, args.vespo_lambda_pos, args.vespo_lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo(t: PolicyTerms, args: Any) -> tuple[torch.Tensor, dict[str, Stat]]:
    """VESPO (arXiv:2602.10693): REINFORCE weighted by a gamma function of the sequence ratio."""
    phi = vespo_weights(t.log_ratio, t.advantages, t.mask, args)
    return -phi * t.advantages * t.logps, {"vespo/phi_seq_mean": masked_mean_stat(phi, t.mask)}


PER_TOKEN_LOSSES: dict[str, Callable[[PolicyTerms, Any], tuple[torch.Tensor, dict[str, Stat]]]] = {
    "grpo": clipped_surrogate,
    "bnpo": clipped_surrogate,
    "dr_grpo": clipped_surrogate,
    "dapo": clipped_surrogate,
    "luspo": clipped_surrogate,
    "cispo": cispo,
    "sapo": sapo,
    "vespo": vespo,
}


# ---- aggregation: (per_token_loss, mask, args, num_items) -> scalar --------------------------------------------


def _sequence_mean(loss, mask, args, num_items):
    """grpo / sapo: token mean per sequence, then mean over sequences (length-biased, arXiv:2503.20783)."""
    return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def _micro_batch_token_mean(loss, mask, args, num_items):
    """bnpo: token mean over the local micro-batch."""
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)


def _constant_length(loss, mask, args, num_items):
    """dr_grpo (Dr. GRPO, arXiv:2503.20783): divide by rows x max_completion_length, a constant."""
    return (loss * mask).sum() / (loss.shape[0] * args.max_completion_length)


def _token_sum(loss, mask, args, num_items):
    """dapo / cispo / vespo: token sum over the caller's normalizer (the batch's active tokens)."""
    return (loss * mask).sum() / num_items


def _length_weighted(loss, mask, args, num_items):
    """luspo (arXiv:2602.05261): sequence loss times its length, mean over sequences (masked first, TRL 1.16)."""
    return (loss * mask).sum(-1).mean()


AGGREGATIONS = {
    "grpo": _sequence_mean,
    "sapo": _sequence_mean,
    "bnpo": _micro_batch_token_mean,
    "dr_grpo": _constant_length,
    "dapo": _token_sum,
    "cispo": _token_sum,
    "vespo": _token_sum,
    "luspo": _length_weighted,
}


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref), per token; >= 0 and unbiased."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def importance_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Token-level log ratio, or its masked mean per sequence (GSPO, arXiv:2507.18071)."""
    if level == "token":
        return log_ratio
    return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


def compute_policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    args: Any,
    ref_logps: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    *,
    entropy_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Stat]]:
    """`policy_loss` with metrics as reducible `Stat`s (the trainer's entry point)."""
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio = logps - old
    ratio = torch.exp(importance_log_weights(log_ratio, mask, args.importance_sampling_level))
    terms = PolicyTerms(logps=logps, log_ratio=log_ratio, ratio=ratio, advantages=advantages, mask=mask)
    per_token_loss, stats = PER_TOKEN_LOSSES[args.loss_type](terms, args)
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if args.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps, the reference model's log-probs of the same tokens.")
        kl = kl_k3(logps, ref_logps)
        if args.use_bias_correction_kl:
            kl = kl * ratio
        per_token_loss = per_token_loss + args.beta * kl
        stats["kl"] = masked_mean_stat(kl, mask)
    if num_items_in_batch is None:
        num_items_in_batch = mask.sum().clamp(min=1.0)
    loss = AGGREGATIONS[args.loss_type](per_token_loss, mask, args, num_items_in_batch)
    return loss, stats


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    args: Any,
    ref_logps: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | float | None = None,
    *,
    entropy_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One process's GRPO-family loss for one micro-batch, and its metrics as floats.

    logps, old_logps, ref_logps, mask: (B, T); old_logps=None means on-policy (ratio 1, gradient of logp);
    advantages: (B,) or (B, T); args: a GRPOConfig (loss_type, epsilon, epsilon_high, delta, beta, ...);
    num_items_in_batch: the divisor of the token-sum losses (dapo, cispo, vespo), used exactly as given
    (default: mask.sum()); entropy_mask: optional (B, T) mask applied to the policy term only.
    """
    loss, stats = compute_policy_loss(logps, old_logps, advantages, mask, args, ref_logps, num_items_in_batch,
                                      entropy_mask=entropy_mask)
    return loss, {name: stat.local() for name, stat in stats.items()}


def entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean token entropy over `mask` (the bonus the caller subtracts, times entropy_coef)."""
    mask = mask.to(entropies.dtype)
    return (entropies * mask).sum() / mask.sum().clamp(min=1.0)


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, all_entropies: torch.Tensor,
                      quantile: float) -> torch.Tensor:
    """Keep tokens whose entropy is in the top `quantile` fraction of `all_entropies` (arXiv:2506.01939).

    `all_entropies` is the flat list of active-token entropies the threshold is taken over (all processes').
    """
    if all_entropies.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    threshold = torch.quantile(all_entropies.float(), 1 - quantile)
    return ((entropies * mask) >= threshold) & mask.bool()
