"""`EngineGroup`: the training processes that share one tensor-parallel generation engine
(`vllm_tensor_parallel_size` > 1, colocate mode): the group, the gathering of its requests and the random stream
its shards sample from. Every method is collective over the group."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from grpo.base import process_env


class EngineGroup:
    """The training processes that share one tensor-parallel engine: with `vllm_tensor_parallel_size` k, processes
    0..k-1, k..2k-1, ... (TRL 1.16's grouping). vLLM's `external_launcher` runs one shard of the engine in each,
    and the shards combine their partial results every layer, so they must be given the same requests in the same
    order and draw the same random numbers, or they would compute different sequences and mix them without any
    error. So every generation gathers the group's requests (processes may bring different numbers of them: the
    later turns of a tool loop), samples them under a seed the group agrees on, and each process keeps its own.
    Built collectively (every process at once), as is each `gather`."""

    def __init__(self, size: int, seed: int, device: str) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        self.size = size
        self.group, _ = dist.new_subgroups_by_enumeration([list(range(i, i + size)) for i in range(0, world, size)])
        self.index = rank // size  # which engine
        self.seed = seed
        self.device = device
        self.generations = 0
        for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", rank)):  # torchrun sets them
            process_env.set_for_dependency(name, str(value), "vLLM's external_launcher reads it")
        token = [uuid.uuid4().hex[:12]]
        dist.broadcast_object_list(token, src=0)
        self.token = token[0]  # the run's own, the same in every process (names what the engine shares)

    def gather(self, requests: Sequence[Any]) -> tuple[list[Any], slice]:
        """Every process's requests in process order, and where this process's are among them. On GPUs the
        processes then meet at a barrier of the whole run (every process gathers as often: the loop's turns are
        agreed collectively), which lets NCCL finish the training's last collectives before the shards' own
        start: TRL's fix for generation hanging on GPUs without NVLink (trl#3671; untested here, no GPU)."""
        parts: list[Any] = [None] * self.size
        dist.all_gather_object(parts, list(requests), group=self.group)
        if self.device == "cuda":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        start = sum(len(part) for part in parts[: dist.get_rank(self.group)])
        return [request for part in parts for request in part], slice(start, start + len(requests))

    @contextlib.contextmanager
    def same_random_numbers(self):
        """vLLM samples from torch's default generator, which the training between generations may have moved
        differently in each process: inside, every shard draws from one stream seeded alike (the engine's seed and
        the generation's number); the trainer's own stream is restored after."""
        self.generations += 1
        devices = [torch.cuda.current_device()] if self.device == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(((self.seed * 1_000_003 + self.index) * 1_000_003 + self.generations) % 2**63)
            yield
