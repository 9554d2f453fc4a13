"""Policy losses of GRPO and its descendants, as pure functions of tensors: one table, one entry per loss type.

    loss, metrics = policy_loss(logps, old_logps, advantages, mask, params)

The math follows the shared spec §2 (TRL 1.16):
1. importance weight `r = exp(log w)`, with `log w = logp - old` per token, or its masked mean per sequence
   (`importance_sampling_level="sequence"`, GSPO);
2. the loss type's per-token objective (`LOSS_TYPES[name].objective`, one function per paper);
3. multiplicative weights, in TRL 1.16's order: the off-policy sequence mask (OPSM, `off_policy_mask`), the
   entropy mask, the sampling-mismatch importance weight rho (`grpo.algo.sampling_correction`; vespo instead folds rho
   into its sequence weight); then `+ beta * kl` (k3 estimator), so the KL term is weighted by none of them;
4. the loss type's aggregation over tokens and rows (`LOSS_TYPES[name].aggregate`);
5. its normalization for gradient accumulation (`LOSS_TYPES[name].normalization`): given a `LossScale` (the
   generation's active-token count, processes, accumulation steps, steps_per_generation), "tokens" losses divide
   their token sum by the generation's active tokens per process and accumulation window, and "accumulation"
   losses divide their micro-batch value by the number of accumulation steps. Without a `LossScale` the loss is
   one process's loss for one micro-batch (token-sum losses divide by `num_items_in_batch`, default the mask's sum).

Parameters come as a frozen `LossParams`, built once from the config (`LossParams.of(config)`; `policy_loss` also
takes the config itself). Metrics are sufficient statistics (`Stat`) so a distributed caller can reduce them
exactly (global masked means, not means of means); the returned `LossMetrics` reads as name -> float for one
process.

A new loss type is one `LossType` entry in `LOSS_TYPES` (with a test and a paper reference); `GRPOConfig` accepts
exactly the names in the table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch


@dataclass
class Stat:
    """A metric as a reducible statistic: `mean` holds (sum, count); `min`/`max` hold one value (NaN: none)."""

    kind: str
    value: torch.Tensor

    def local(self) -> float:
        if self.kind == "mean":
            return (self.value[0] / self.value[1].clamp(min=1.0)).item()
        return self.value.item()


class LossMetrics(Mapping):
    """name -> float (this process's value, computed when read); `stats` keeps the reducible statistics."""

    def __init__(self, stats: dict[str, Stat]) -> None:
        self.stats = stats

    def __getitem__(self, name: str) -> float:
        return self.stats[name].local()

    def __iter__(self) -> Iterator[str]:
        return iter(self.stats)

    def __len__(self) -> int:
        return len(self.stats)


@dataclass(frozen=True)
class LossParams:
    """Everything the loss math reads, and nothing else."""

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = True  # TRL 1.16 (GRPOConfig) default
    max_completion_length: int = 256
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None

    @classmethod
    def of(cls, config: Any) -> LossParams:
        """The parameters of a GRPOConfig (or anything with its field names); a LossParams as it is."""
        if isinstance(config, LossParams):
            return config
        values = {f.name: getattr(config, f.name) for f in fields(cls) if f.name != "epsilon_low"}
        values["epsilon_low"] = config.epsilon
        if values["epsilon_high"] is None:
            values["epsilon_high"] = config.epsilon
        return cls(**values)


@dataclass(frozen=True)
class LossScale:
    """How one micro-batch's loss relates to the optimizer step's: `tokens` active (trained) tokens in the whole
    generation batch (every process), split over `processes`, fed to the optimizer in `steps_per_generation`
    micro-steps, `accumulation_steps` of them per optimizer step."""

    tokens: float
    processes: int = 1
    accumulation_steps: int = 1
    steps_per_generation: int = 1

    def token_divisor(self) -> float:
        """The divisor of a token-sum loss (TRL 1.16: N/P x GA/steps_per_generation)."""
        return max(self.tokens, 1.0) / self.processes * self.accumulation_steps / self.steps_per_generation


@dataclass
class PolicyTerms:
    """What every per-token objective may read. Shapes: (B, T), or (B, 1) for sequence-level terms."""

    logps: torch.Tensor  # log pi_theta of the sampled tokens, with gradient
    log_ratio: torch.Tensor  # logp - old, per token (B, T)
    ratio: torch.Tensor  # importance weight r: token (B, T) or sequence (B, 1)
    advantages: torch.Tensor  # (B, 1) or (B, T)
    mask: torch.Tensor  # (B, T) float, 1 on trained tokens
    is_ratio: torch.Tensor | None = None  # sampling-mismatch weight rho, (B, T) or (B, 1); read by vespo only


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


# ---- per-token objectives: (terms, params) -> (per_token_loss, stats) ------------------------------------------


def clipped_surrogate(t: PolicyTerms, p: LossParams) -> tuple[torch.Tensor, dict[str, Stat]]:
    """PPO-style clipped objective (GRPO, DeepSeekMath arXiv:2402.03300; DAPO's epsilon_high, arXiv:2503.14476;
    INTELLECT-2's delta cap on the unclipped branch, arXiv:2505.07291)."""
    ratio = t.ratio
    clipped = torch.clamp(ratio, 1 - p.epsilon_low, 1 + p.epsilon_high)
    if p.delta is not None:
        ratio = torch.clamp(ratio, max=p.delta)
    loss = -torch.min(ratio * t.advantages, clipped * t.advantages)
    low = ((ratio < 1 - p.epsilon_low) & (t.advantages < 0)).float()
    high = ((ratio > 1 + p.epsilon_high) & (t.advantages > 0)).float()
    region = ((low + high) > 0).float()
    stats = {
        "clip_ratio/low_mean": masked_mean_stat(low, t.mask),
        "clip_ratio/high_mean": masked_mean_stat(high, t.mask),
        "clip_ratio/region_mean": masked_mean_stat(region, t.mask),
        "clip_ratio/low_min": _nan_extreme(_per_sequence(low, t.mask), "min"),
        "clip_ratio/high_max": _nan_extreme(_per_sequence(high, t.mask), "max"),
    }
    return loss, stats


def cispo(t: PolicyTerms, p: LossParams) -> tuple[torch.Tensor, dict[str, Stat]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): REINFORCE weighted by the detached ratio capped at epsilon_high
    (an absolute cap, as the reference implements it)."""
    capped = torch.clamp(t.ratio, max=p.epsilon_high).detach()
    loss = -capped * t.advantages * t.logps
    clipped = ((t.ratio > p.epsilon_high) & (t.advantages > 0)).float()
    return loss, {"cispo_clip_ratio": masked_mean_stat(clipped, t.mask)}


def sapo(t: PolicyTerms, p: LossParams) -> tuple[torch.Tensor, dict[str, Stat]]:
    """SAPO (arXiv:2511.20347): a sigmoid soft gate instead of a hard clip; gradient weight 1 at r = 1."""
    tau = torch.where(t.advantages > 0, p.sapo_temperature_pos, p.sapo_temperature_neg)
    return -(torch.sigmoid(tau * (t.ratio - 1)) * 4 / tau) * t.advantages, {}


@torch.no_grad()
def vespo_weights(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    p: LossParams,
    is_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """VESPO's per-sequence gamma weight phi(W) = W^k e^{lambda (1 - W)}, with W the product of token ratios.

    A sampling-mismatch weight rho (pi_old / pi_sampler) joins W in log space: TRL 1.16 adds
    sum_t clamp(log rho_t, log 1e-8, 20) over every position, unmasked (padding carries rho = 1, log 0).
    """
    floor = math.log(1e-8)
    seq_log_ratio = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_ratio is not None:
        seq_log_ratio = seq_log_ratio + torch.clamp(torch.log(is_ratio), floor, 20.0).sum(-1, keepdim=True)
    log_w = torch.clamp(seq_log_ratio, floor, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, p.vespo_k_pos, p.vespo_k_neg)
    lam = torch.where(nonneg, p.vespo_lambda_pos, p.vespo_lambda_neg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo(t: PolicyTerms, p: LossParams) -> tuple[torch.Tensor, dict[str, Stat]]:
    """VESPO (arXiv:2602.10693): REINFORCE weighted by a gamma function of the sequence ratio."""
    phi = vespo_weights(t.log_ratio, t.advantages, t.mask, p, t.is_ratio)
    return -phi * t.advantages * t.logps, {"vespo/phi_seq_mean": masked_mean_stat(phi, t.mask)}


# ---- aggregation: (per_token_loss, mask, params, num_items) -> scalar ------------------------------------------


def sequence_mean(loss, mask, p, num_items):
    """Token mean per sequence, then mean over sequences (length-biased, arXiv:2503.20783)."""
    return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def micro_batch_token_mean(loss, mask, p, num_items):
    """Token mean over the local micro-batch."""
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)


def constant_length(loss, mask, p, num_items):
    """Divide by rows x max_completion_length, a constant (Dr. GRPO, arXiv:2503.20783)."""
    return (loss * mask).sum() / (loss.shape[0] * p.max_completion_length)


def token_sum(loss, mask, p, num_items):
    """Token sum over the caller's normalizer (the batch's active tokens)."""
    return (loss * mask).sum() / num_items


def length_weighted(loss, mask, p, num_items):
    """Sequence loss times its length, mean over sequences (masked first, TRL 1.16)."""
    return (loss * mask).sum(-1).mean()


Objective = Callable[[PolicyTerms, LossParams], tuple[torch.Tensor, dict[str, Stat]]]
Aggregation = Callable[[torch.Tensor, torch.Tensor, LossParams, Any], torch.Tensor]


@dataclass(frozen=True)
class LossType:
    """One loss type: its per-token objective, its aggregation, and how accumulation normalizes it ("tokens":
    the aggregation divides a token sum by `LossScale.token_divisor()`; "accumulation": the aggregation is a
    micro-batch value, divided by the number of accumulation steps)."""

    objective: Objective
    aggregate: Aggregation
    normalization: str
    paper: str
    # the objective weighs each token by the sampling-mismatch ratio rho itself (vespo), rather than the loss
    # being multiplied by it afterwards
    folds_is_ratio: bool = False


LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType(clipped_surrogate, sequence_mean, "accumulation", "DeepSeekMath, arXiv:2402.03300"),
    "bnpo": LossType(clipped_surrogate, micro_batch_token_mean, "accumulation", "BNPO, arXiv:2506.02864"),
    "dr_grpo": LossType(clipped_surrogate, constant_length, "accumulation", "Dr. GRPO, arXiv:2503.20783"),
    "dapo": LossType(clipped_surrogate, token_sum, "tokens", "DAPO, arXiv:2503.14476"),
    "cispo": LossType(cispo, token_sum, "tokens", "MiniMax-M1, arXiv:2506.13585"),
    "sapo": LossType(sapo, sequence_mean, "accumulation", "SAPO, arXiv:2511.20347"),
    "luspo": LossType(clipped_surrogate, length_weighted, "accumulation", "LUSPO, arXiv:2602.05261"),
    "vespo": LossType(vespo, token_sum, "tokens", "VESPO, arXiv:2602.10693", folds_is_ratio=True),
}


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref), per token; >= 0 and unbiased."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


@torch.no_grad()
def off_policy_mask(
    advantages: torch.Tensor,
    logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """The off-policy sequence mask (OPSM, DeepSeek-V3.2, arXiv:2512.02556), (B, 1): 1 keeps a row, 0 drops it.

    A row is dropped only when its advantage is negative and the sampler has drifted from the current policy by
    more than `threshold`: kl_i = sum_t m_t (q_t - sg(logp_t)) / max(sum_t m_t, 1), with q the sampler's
    log-probs. A NaN q_t (a token the engine did not score) counts as no drift, so one unscorable token cannot
    drop a row. Advantages are (B,) or (B, 1).
    """
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    mask = mask.to(logps.dtype)
    drift = torch.nan_to_num(sampler_logps - logps.detach(), nan=0.0)
    seq_kl = (drift * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (seq_kl <= threshold)).to(logps.dtype)


def importance_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Token-level log ratio, or its masked mean per sequence (GSPO, arXiv:2507.18071)."""
    if level == "token":
        return log_ratio
    return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)


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
    scale: LossScale | None = None,
    sampler_logps: torch.Tensor | None = None,
    is_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossMetrics]:
    """The GRPO-family loss of one micro-batch, and its metrics.

    logps, old_logps, ref_logps, mask: (B, T); old_logps=None means on-policy (ratio 1, gradient of logp);
    advantages: (B,) or (B, T); args: `LossParams`, or a GRPOConfig; num_items_in_batch: the divisor of the
    token-sum losses (dapo, cispo, vespo), used exactly as given (default: mask.sum()); entropy_mask: optional
    (B, T) mask applied to the policy term only; scale: the micro-batch's place in the optimizer step (see
    `LossScale`), which applies the loss type's normalization for accumulation and replaces num_items_in_batch;
    sampler_logps: the sampling engine's (B, T) log-probs, which OPSM compares with (default: old_logps, as 1.16),
    used only when `off_policy_mask_threshold` is set; is_ratio: the sampling-mismatch weight rho
    (`grpo.algo.sampling_correction.sampling_ratio`, (B, T) or (B, 1)), a constant multiplier of the policy term
    (vespo: a factor of its sequence weight instead).
    """
    p = LossParams.of(args)
    loss_type = LOSS_TYPES[p.loss_type]
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio = logps - old
    ratio = torch.exp(importance_log_weights(log_ratio, mask, p.importance_sampling_level))
    if is_ratio is not None:
        is_ratio = is_ratio.detach()
    terms = PolicyTerms(logps, log_ratio, ratio, advantages, mask, is_ratio if loss_type.folds_is_ratio else None)
    per_token_loss, stats = loss_type.objective(terms, p)
    if p.off_policy_mask_threshold is not None:
        sampler = old if sampler_logps is None else sampler_logps
        per_token_loss = per_token_loss * off_policy_mask(advantages, logps, sampler, mask, p.off_policy_mask_threshold)
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if is_ratio is not None and not loss_type.folds_is_ratio:
        per_token_loss = per_token_loss * is_ratio
    if p.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps, the reference model's log-probs of the same tokens.")
        kl = kl_k3(logps, ref_logps)
        if p.use_bias_correction_kl:
            kl = kl * ratio
        per_token_loss = per_token_loss + p.beta * kl
        stats["kl"] = masked_mean_stat(kl, mask)
    if scale is not None and loss_type.normalization == "tokens":
        num_items_in_batch = scale.token_divisor()
    elif num_items_in_batch is None:
        num_items_in_batch = mask.sum().clamp(min=1.0)
    loss = loss_type.aggregate(per_token_loss, mask, p, num_items_in_batch)
    if scale is not None and loss_type.normalization == "accumulation":
        loss = loss / scale.accumulation_steps
    return loss, LossMetrics(stats)


def entropy_bonus(entropies: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean token entropy over `mask` (the bonus the caller subtracts, times entropy_coef)."""
    mask = mask.to(entropies.dtype)
    return (entropies * mask).sum() / mask.sum().clamp(min=1.0)


def high_entropy_mask(
    entropies: torch.Tensor, mask: torch.Tensor, all_entropies: torch.Tensor, quantile: float
) -> torch.Tensor:
    """Keep tokens whose entropy is in the top `quantile` fraction of `all_entropies` (arXiv:2506.01939).

    `all_entropies` is the flat list of active-token entropies the threshold is taken over (all processes').
    """
    return entropy_cut_mask(entropies, mask, all_entropies, 1 - quantile)


def entropy_cut_mask(
    entropies: torch.Tensor, mask: torch.Tensor, all_entropies: torch.Tensor, level: float
) -> torch.Tensor:
    """The active tokens whose entropy is at or above the `level` quantile of `all_entropies` (none if it is empty);
    TRL's `get_high_entropy_mask` takes this `level` (1 - top_entropy_quantile)."""
    if all_entropies.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    threshold = torch.quantile(all_entropies.float(), level)
    return ((entropies * mask) >= threshold) & mask.bool()
