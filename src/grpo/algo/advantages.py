"""Group-relative advantages from per-function rewards: a pure function (shared spec §3).

Rewards arrive as a (N, K) tensor, N completions of the *global* batch (rows k*G .. k*G+G-1 are one prompt's
group) and K reward functions; NaN marks "this function does not apply to this row" (a `None` returned by a
reward function).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPS = 1e-4  # the reference's epsilon in A = (R - mean) / (std + eps)


@dataclass
class Advantages:
    advantages: torch.Tensor  # (N,), 0 for unscorable rows and groups without spread
    rewards: torch.Tensor  # (N,) weighted reward sum, NaN where no function applied
    std: torch.Tensor  # (N,) the std each row was divided by (group or batch)
    frac_zero_std: float  # fraction of rows whose std is (close to) 0


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaN; NaN where fewer than two values are valid."""
    valid = ~torch.isnan(x)
    n = valid.sum(dim=dim, keepdim=True) if dim is not None else valid.sum()
    mean = torch.nanmean(x, dim=dim, keepdim=True) if dim is not None else torch.nanmean(x)
    sq = torch.where(valid, (x - mean) ** 2, torch.zeros_like(x))
    total = sq.sum(dim=dim, keepdim=True) if dim is not None else sq.sum()
    std = torch.sqrt(total / (n - 1))
    std = torch.where(n >= 2, std, torch.full_like(std, float("nan")))
    return std if keepdim or dim is None else std.squeeze(dim)


def weighted_sum(values: torch.Tensor, weights: torch.Tensor, unscorable: torch.Tensor) -> torch.Tensor:
    """Sum of weighted values ignoring NaN entries; NaN for the unscorable rows."""
    total = torch.nansum(values * weights.unsqueeze(0), dim=1)
    return torch.where(unscorable, torch.full_like(total, float("nan")), total)


def compute_advantages(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> Advantages:
    """A_i = (R_i - mean of its group) / (std + 1e-4), std per group ("group"), over the batch ("batch"), or no
    division ("none"). `aggregation="normalize_then_sum"` (GDPO) normalizes each function within the group
    first, then normalizes the weighted sum over the batch; scale_rewards is ignored there.

    A row is unscorable when every function returned None for it: its reward is NaN and its advantage 0."""
    rewards_per_func = rewards_per_func.float()
    weights = weights.to(rewards_per_func)
    n = rewards_per_func.shape[0]
    if n % num_generations != 0:
        raise ValueError(f"{n} rewards do not split into groups of num_generations={num_generations}.")
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = weighted_sum(rewards_per_func, weights, unscorable)
    if aggregation == "normalize_then_sum":
        grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
        z = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (_group_std(grouped) + STD_EPS)
        combined = weighted_sum(z.reshape(n, -1), weights, unscorable)
        std = nanstd(combined).expand(n)
        advantages = (combined - torch.nanmean(combined)) / (std + STD_EPS)
    else:
        grouped = rewards.view(-1, num_generations)
        mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
        if scale_rewards == "batch":
            std = nanstd(rewards).expand(n)
        else:
            std = _group_std(grouped).repeat_interleave(num_generations)
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + STD_EPS)
    is_zero = torch.isclose(std, torch.zeros_like(std))
    return Advantages(
        advantages=torch.nan_to_num(advantages, nan=0.0),
        rewards=rewards,
        std=std,
        frac_zero_std=is_zero.float().mean().item(),
    )


def _group_std(grouped: torch.Tensor) -> torch.Tensor:
    """Std over each group (dim 1; kept for per-function (groups, G, K) input); 0 for groups of one."""
    keep = grouped.dim() == 3
    if grouped.shape[1] == 1:
        return torch.zeros_like(grouped.sum(dim=1, keepdim=keep))
    return nanstd(grouped, dim=1, keepdim=keep)
