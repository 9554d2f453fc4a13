"""One process of the two-process run of `tests/integration/test_runtime_fields.py` (torchrun, gloo on CPU): a trainer
with every DDP and process-group field set and average_tokens_across_devices=False trains one step; each process writes
what its DDP wrapper and process group were built with, and the token counts its loss was normalized by.

    python -m torch.distributed.run --nproc_per_node=2 tests/ddp_fields_job.py OUT MODEL_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from support.rewards import length_reward

DDP_FIELDS = dict(
    ddp_find_unused_parameters=True,
    ddp_bucket_cap_mb=1,
    ddp_broadcast_buffers=False,
    ddp_backend="gloo",
    ddp_timeout=123,
)


def main() -> None:
    out, model_dir = sys.argv[1:3]
    rows = [{"prompt": [{"role": "user", "content": f"Solve {i}+1"}]} for i in range(8)]
    args = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=1,
        logging_steps=1,
        disable_tqdm=True,
        save_strategy="no",
        bf16=False,
        seed=0,
        gradient_checkpointing=False,
        average_tokens_across_devices=False,
        **DDP_FIELDS,
    )
    trainer = GRPOTrainer(model=model_dir, reward_funcs=length_reward, train_dataset=Dataset.from_list(rows), args=args)
    counted = []
    collate = trainer._collate

    def counting(scored, advantages):
        batch = collate(scored, advantages)
        counted.append([float(batch.mask.sum()), batch.num_items_in_batch])
        return batch

    trainer._collate = counting
    trainer.train()
    ddp = trainer.model
    rank = dist.get_rank()
    row = dict(
        world=dist.get_world_size(),
        wrapper=type(ddp).__name__,
        find_unused_parameters=ddp.find_unused_parameters,
        bucket_bytes_cap=ddp.bucket_bytes_cap,
        broadcast_buffers=ddp.broadcast_buffers,
        backend=dist.get_backend(),
        timeout_s=dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds(),
        counted=counted,
        steps=trainer.state.global_step,
    )
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)


if __name__ == "__main__":
    main()
