"""Sampling from a sharded model, launched with torchrun (gloo on CPU) by test_fsdp.py:

    torchrun --nproc_per_node N fsdp_job.py OUT

Every decoder layer and the root are sharded with FSDP2 (`fully_shard`, what accelerate's fsdp_version 2
applies); the fast engine's lean decoder then samples greedily. The main process writes the tokens, those of the
same model unsharded, the log-probs the sampler recorded, and whether the parameters are sharded again after."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from grpo.fast_generation import FastEngine
from test_fast_generation import greedy, setup


def sample(model, args, stop, pad_id, rows):
    engine = FastEngine(model, args, stop, pad_id, sampler=greedy)
    assert engine.lean_reason is None, engine.lean_reason
    rollout = engine.generate(rows)
    return rollout.completion_ids, rollout.sampling_logps


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tok, model, args, stop, rows = setup()
    whole_ids, whole_logps = sample(model, args, stop, tok.pad_token_id, rows)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor)
    ids, logps = sample(model, args, stop, tok.pad_token_id, rows)
    resharded = all(isinstance(p, DTensor) for p in model.parameters())
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"world": dist.get_world_size(), "ids": ids, "whole_ids": whole_ids, "logps": logps,
                       "whole_logps": whole_logps, "resharded": resharded}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
