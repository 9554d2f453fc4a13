"""Collectives the loop needs, written so that the loop reads the same on 1 and N processes: each is the identity
(or the obvious local value) on one process."""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator

from grpo.algo.losses import Stat
from grpo.base import sigterm


def any_process(accelerator: Accelerator, flag: bool) -> bool:
    """True on every process when the flag is set on any of them."""
    if accelerator.num_processes == 1:
        return flag
    return bool(accelerator.reduce(torch.tensor(float(flag), device=accelerator.device), "sum") > 0)


def any_process_or_preempted(accelerator: Accelerator, flag: bool) -> bool:
    """`any_process`, where the processes meet again and again inside a step (a tool loop's check): once SIGTERM
    has reached any of them (`sigterm.requested`), every one raises `Preempted(agreed=True)` here instead."""
    if accelerator.num_processes == 1:
        return flag
    both = accelerator.reduce(torch.tensor([float(flag), float(sigterm.requested())], device=accelerator.device))
    if both[1] > 0:
        raise sigterm.Preempted("SIGTERM reached a process during a tool loop", agreed=True)
    return bool(both[0] > 0)


def process_mean(accelerator: Accelerator, value: float) -> float:
    """The mean of a number over processes (the same on every process)."""
    if accelerator.num_processes == 1:
        return value
    return float(accelerator.reduce(torch.tensor(float(value), device=accelerator.device), "mean"))


def loss_tokens(accelerator: Accelerator, local_tokens: torch.Tensor, across_processes: bool) -> float:
    """`num_items_in_batch`, the token count the token-sum losses (dapo, cispo, vespo) divide by, over the whole
    generation batch: every process's trained tokens (average_tokens_across_devices=True, the default; TRL 1.16
    always counts these), or this process's own times the number of processes (False: each process normalises
    by its own tokens, as the HF Trainer does without averaging, since `LossScale` divides the count by the
    number of processes; DDP's gradient average then makes the update a mean of per-process token means)."""
    if not across_processes:
        return float(local_tokens) * accelerator.num_processes
    return float(accelerator.reduce(local_tokens, reduction="sum"))


def local_rows(n: int, process_index: int, num_processes: int) -> range:
    """This process's contiguous, even share of n global rows."""
    return range(process_index * n // num_processes, (process_index + 1) * n // num_processes)


def gather_values(values: torch.Tensor, accelerator: Accelerator) -> torch.Tensor:
    """Every process's 1-d tensor of values, concatenated in process order (they may differ in length)."""
    padded = accelerator.pad_across_processes(values, dim=0, pad_index=-1e9)
    everyone = accelerator.gather(padded)
    return everyone[everyone != -1e9]


def reduce_stats(stats: dict[str, Stat], accelerator: Accelerator) -> dict[str, float]:
    """Loss statistics (`grpo.algo.losses.Stat`) reduced over processes: global masked means, min of mins, max of
    maxes. One collective and one host sync per call, whatever the number of statistics: each process's values
    (a mean's sum and count, a min's or max's value) go in one row, every process's row is gathered at once, and
    the table is read back to the host once."""
    if not stats:
        return {}
    row = torch.cat([stat.value.detach().to(accelerator.device).float().reshape(-1) for stat in stats.values()])
    table = accelerator.gather(row[None]) if accelerator.num_processes > 1 else row[None]
    table = table.cpu()
    out, column = {}, 0
    for name, stat in stats.items():
        if stat.kind == "mean":
            total = table[:, column : column + 2].sum(0)
            out[name] = (total[0] / total[1].clamp(min=1.0)).item()  # float32, as the statistic is
            column += 2
        else:
            valid = [v for v in table[:, column].tolist() if not math.isnan(v)]
            out[name] = (min(valid) if stat.kind == "min" else max(valid)) if valid else math.nan
            column += 1
    return out
