"""Sharded checkpoints (FSDP2 on CPU), launched with torchrun (gloo) by test_fsdp.py:

    torchrun --nproc_per_node N fsdp_resume_job.py OUT straight|save|resume

straight: 3 AdamW steps; save: 2 steps, then `sharding.save_shards` into OUT/sharded and the whole state dict
(`model_state`) next to it; resume: a fresh sharded model and optimizer, `sharding.load_shards`, 1 step. The main
process writes the final whole parameters to OUT/<mode>.pt."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from grpo import checkpoint
from grpo.distributed import sharding
from support.tiny import make_model, make_tokenizer


def sharded_model_and_optimizer():
    model = make_model(make_tokenizer(), hidden=64)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model, optimizer, k):
    ids = torch.randint(5, 100, (4, 12), generator=torch.Generator().manual_seed(k))
    loss = model(input_ids=ids).logits.float().log_softmax(-1)[..., 7].mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def whole(model):
    return checkpoint.model_state(model, None)  # a sharded model: gathered, no accelerator read


def main() -> None:
    out, mode = sys.argv[1:3]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model, optimizer = sharded_model_and_optimizer()
    if mode == "resume":
        sharding.load_shards(model, optimizer, os.path.join(out, "sharded"))
        steps = [2]
    else:
        steps = [0, 1, 2] if mode == "straight" else [0, 1]
    for k in steps:
        step(model, optimizer, k)
    if mode == "save":
        sharding.save_shards(model, optimizer, os.path.join(out, "sharded"))
    state = whole(model)
    if dist.get_rank() == 0:
        torch.save(state, os.path.join(out, f"{mode}.pt"))
    dist.barrier()
    time.sleep(0.2)  # let gloo's workers drop the last collectives before teardown (see runtime.settle_processes)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
