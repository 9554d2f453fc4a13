"""A generation batch's scored completions in global order (every process's rows), and the DAPO dynamic-sampling
filter over its groups.

Each process generates and scores its own share of a round; `gather_scored` puts the
shares together in process order, so every process sees the same global batch: rewards are normalized over whole
groups (shared spec §3: groups may straddle processes), groups are kept or dropped identically everywhere, and
each process then trains on an even, contiguous slice.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from accelerate.utils import gather_object

from grpo.algo.advantages import nanstd, weighted_sum
from grpo.base.records import Rollout
from grpo.base.sigterm import Preempted
from grpo.config import ResolvedConfig

logger = logging.getLogger("grpo")


@dataclass
class Scored:
    rows: list[int]  # the dataset row each completion answers
    prompts: list  # the prompts as the dataset gives them
    rollout: Rollout
    rewards: torch.Tensor  # (N, K) per reward function, NaN where a function returned None
    extra: dict[str, list] = field(default_factory=dict)  # columns reward functions added with log_extra

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, rows: Sequence[int]) -> Scored:
        rows = list(rows)
        return Scored(
            rows=[self.rows[i] for i in rows],
            prompts=[self.prompts[i] for i in rows],
            rollout=self.rollout.select(rows),
            rewards=self.rewards[torch.tensor(rows, dtype=torch.long)],
            extra={k: [v[i] for i in rows] for k, v in self.extra.items()},
        )

    @staticmethod
    def concat(parts: Sequence[Scored]) -> Scored:
        keys = [k for part in parts for k in part.extra]
        extra = {k: [x for part in parts for x in part.extra.get(k, [None] * len(part))] for k in dict.fromkeys(keys)}
        lists = {
            f.name: [x for part in parts for x in getattr(part, f.name)]
            for f in fields(Scored)
            if f.name in ("rows", "prompts")
        }
        return Scored(
            **lists,
            rollout=Rollout.concat([p.rollout for p in parts]),
            rewards=torch.cat([p.rewards for p in parts]),
            extra=extra,
        )


@dataclass(frozen=True)
class GenerationBatch:
    """One generation batch as the rounds made it (`grpo.rounds.sequential.Rounds.next`): the completions kept
    (every process's, in global order), how many rounds (data positions) it took and how many groups dynamic
    sampling dropped, this process's time generating, scoring and gathering, the completion tokens it sampled, and
    what its reward functions logged with `log_metric`, in order."""

    batch: Scored
    rounds: int = 1
    groups_dropped: int = 0
    generation_s: float = 0.0
    scoring_s: float = 0.0
    gather_s: float = 0.0
    tokens: int = 0  # completion tokens this process sampled (tool results are not)
    logged: tuple[tuple[str, float], ...] = ()


def kept_rows(kept: Sequence[Scored], last_round: Scored, wanted: int, rounds: int, num_generations: int) -> Scored:
    """At most `wanted` of the completions dynamic sampling kept over `rounds` rounds. With none kept, the last
    round as it came (advantages all 0); a short batch trains on what it has. Both are said in a warning."""
    scored = Scored.concat(kept)
    batch = scored.select(range(min(len(scored), wanted)))
    if len(batch) == 0:
        logger.warning(
            "Dynamic sampling: no group had reward spread in %d rounds; this step's policy gradient is "
            "zero. Check the reward functions, or raise dynamic_sampling_max_attempts.",
            rounds,
        )
        return last_round
    if len(batch) < wanted:
        logger.warning(
            "Dynamic sampling: %d of %d groups have reward spread after %d rounds; this step trains on those.",
            len(batch) // num_generations,
            wanted // num_generations,
            rounds,
        )
    return batch


def groups_with_spread(
    rewards: torch.Tensor, weights: torch.Tensor, num_generations: int, threshold: float
) -> torch.Tensor:
    """(N/G,) bool: the groups whose combined reward has a std of at least `threshold` (DAPO dynamic sampling).
    A group with fewer than two scorable completions has no spread."""
    unscorable = torch.isnan(rewards).all(dim=1)
    combined = weighted_sum(rewards.float(), weights.float(), unscorable).view(-1, num_generations)
    std = nanstd(combined, dim=1)
    return ~torch.isnan(std) & (std >= threshold)


def rows_of_groups(groups: torch.Tensor, num_generations: int) -> list[int]:
    """The completion rows of the groups marked True."""
    return [g * num_generations + j for g in groups.nonzero().squeeze(-1).tolist() for j in range(num_generations)]


def rows_with_spread(scored: Scored, weights: torch.Tensor, args: ResolvedConfig) -> list[int]:
    """The rows of the groups whose rewards differ (DAPO dynamic sampling keeps only those)."""
    spread = groups_with_spread(scored.rewards, weights, args.num_generations, args.dynamic_sampling_std_threshold)
    return rows_of_groups(spread, args.num_generations)


def gather_scored(local: Scored | None, accelerator: Any) -> Scored:
    """Every process's share of a round, in process order (the identity on one process). None: SIGTERM stopped
    this process making its share (`sigterm.agreed_or_none`); every process then raises `Preempted(agreed=True)`."""
    if accelerator.num_processes == 1:
        assert local is not None  # on one process SIGTERM raised where it came (`agreed_or_none`)
        return local
    parts = gather_object([local])
    if any(part is None for part in parts):
        raise Preempted("SIGTERM reached a process while it made its share of a round", agreed=True)
    return Scored.concat(parts)
