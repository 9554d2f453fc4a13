"""A generation round's scored completions in global order (every process's rows), and the DAPO dynamic-sampling
filter over them.

Each process generates and scores its own share of a round; `gather_scored` puts the shares together in process
order, so every process sees the same global batch: rewards are normalized over whole groups (shared spec §3:
groups may straddle processes), groups are kept or dropped identically everywhere, and each process then
trains on an even, contiguous slice (`local_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from grpo.advantages import nanstd, weighted_sum
from grpo.generation import Rollout


@dataclass
class Scored:
    rows: list[int]  # the dataset row each completion answers
    prompts: list  # the prompts as the dataset gives them
    rollout: Rollout
    texts: list[str]  # decoded completions
    rewards: torch.Tensor  # (N, K) per reward function, NaN where a function returned None
    extra: dict[str, list] = field(default_factory=dict)  # columns reward functions added with log_extra

    def __len__(self) -> int:
        return len(self.rows)

    def select(self, rows: Sequence[int]) -> Scored:
        rows = list(rows)
        return Scored(rows=[self.rows[i] for i in rows], prompts=[self.prompts[i] for i in rows],
                      rollout=self.rollout.select(rows), texts=[self.texts[i] for i in rows],
                      rewards=self.rewards[torch.tensor(rows, dtype=torch.long)],
                      extra={k: [v[i] for i in rows] for k, v in self.extra.items()})

    @staticmethod
    def concat(parts: Sequence[Scored]) -> Scored:
        keys = [k for part in parts for k in part.extra]
        extra = {k: [x for part in parts for x in part.extra.get(k, [None] * len(part))] for k in dict.fromkeys(keys)}
        lists = {f.name: [x for part in parts for x in getattr(part, f.name)]
                 for f in fields(Scored) if f.name in ("rows", "prompts", "texts")}
        return Scored(**lists, rollout=Rollout.concat([p.rollout for p in parts]),
                      rewards=torch.cat([p.rewards for p in parts]), extra=extra)


def gather_scored(local: Scored, accelerator: Any) -> Scored:
    """Every process's share of a round, in process order (the identity on one process)."""
    if accelerator.num_processes == 1:
        return local
    from accelerate.utils import gather_object

    return Scored.concat(gather_object([local]))


def groups_with_spread(rewards: torch.Tensor, weights: torch.Tensor, num_generations: int,
                       threshold: float) -> torch.Tensor:
    """(N/G,) bool: the groups whose combined reward has a std of at least `threshold` (DAPO dynamic sampling).
    A group with fewer than two scorable completions has no spread."""
    unscorable = torch.isnan(rewards).all(dim=1)
    combined = weighted_sum(rewards.float(), weights.float(), unscorable).view(-1, num_generations)
    std = nanstd(combined, dim=1)
    return ~torch.isnan(std) & (std >= threshold)


def rows_of_groups(groups: torch.Tensor, num_generations: int) -> list[int]:
    """The completion rows of the groups marked True."""
    return [g * num_generations + j for g in groups.nonzero().squeeze(-1).tolist() for j in range(num_generations)]


def local_rows(n: int, process_index: int, num_processes: int) -> range:
    """This process's contiguous, even share of n global rows."""
    return range(process_index * n // num_processes, (process_index + 1) * n // num_processes)
