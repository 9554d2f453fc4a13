"""Sampling from and training a sharded model, launched with torchrun (gloo on CPU) by test_fsdp.py:

    torchrun --nproc_per_node N fsdp_job.py OUT

Every decoder layer and the root are sharded with FSDP2 (`fully_shard`, what accelerate's fsdp_version 2
applies). The fast engine's lean decoder samples greedily; then the training pass (prefix-shared forward, tiled
output head, lean norm and MLP blocks) scores the completions and back-propagates. The main process writes
the tokens, log-probs and gradients (gathered whole) next to those of the same model unsharded, and whether
the parameters are sharded again after sampling."""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from grpo.learner.batch import collate
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings
from grpo.perf.blocks import lean_blocks
from grpo.rollout.fast import FastEngine
from support.decode import greedy, setup


def sample(model, tok, args, stop, requests):
    engine = FastEngine(model, tok, args, stop, sampler=greedy)
    assert engine.lean_reason is None, engine.lean_reason
    rollout = engine.generate(requests)
    return rollout.completion_ids, rollout.sampling_logps


def train_pass(model, rollout_ids, requests, pad_id):
    """Log-probs of the sampled completions and the gradients of their sum (whole tensors), inside `lean_blocks`
    as the trainer runs it (its own equivalence to the plain blocks: test_lean_blocks.py)."""
    from grpo.base.records import Rollout

    rows = [list(r.prompt.ids) for r in requests for _ in range(r.num_samples)]
    rollout = Rollout(
        prompt_ids=rows,
        completion_ids=rollout_ids,
        sampling_logps=[[0.0] * len(c) for c in rollout_ids],
        truncated=[False] * len(rows),
    )
    batch = collate(
        rollout,
        torch.zeros(len(rows)),
        pad_id,
        mask_truncated=False,
        group=torch.tensor([i // 4 for i in range(len(rows))]),
    )
    model.zero_grad()
    with lean_blocks(model):
        logps = token_logps(model, batch, PassSettings(0.9, chunked_head=True, layouts=("shared_prefix",))).logps
    (logps * batch.mask).sum().backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}
    return (logps * batch.mask).tolist(), grads


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tok, model, args, stop, rows = setup()
    whole_ids, whole_logps = sample(model, tok, args, stop, rows)
    whole_train, whole_grads = train_pass(model, whole_ids, rows, tok.pad_token_id)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor)
    ids, logps = sample(model, tok, args, stop, rows)
    resharded = all(isinstance(p, DTensor) for p in model.parameters())
    train, grads = train_pass(model, whole_ids, rows, tok.pad_token_id)
    if dist.get_rank() == 0:
        torch.save({"grads": grads, "whole_grads": whole_grads}, out + ".grads.pt")
        with open(out, "w") as f:
            json.dump(
                {
                    "world": dist.get_world_size(),
                    "ids": ids,
                    "whole_ids": whole_ids,
                    "logps": logps,
                    "whole_logps": whole_logps,
                    "resharded": resharded,
                    "train": train,
                    "whole_train": whole_train,
                },
                f,
            )
    dist.barrier()
    time.sleep(0.2)  # let gloo's workers drop the last collectives before teardown (see settle_processes)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
