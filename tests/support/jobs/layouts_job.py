"""packing="auto" under DDP, launched with torchrun (gloo on CPU) by test_distributed.py:

    torchrun --nproc_per_node 2 layouts_job.py OUT

Each process scores a micro-batch of its own through a DDP-wrapped tiny model, whose every forward broadcasts its
buffers (a collective): process 0 ragged completions after long prompts (alone it would take trees), process 1
long even completions after a short shared prompt (alone: padded rows, whose shared prompt takes two forwards).
Each writes what it would choose alone, the layouts its pieces took, and its log-probs and gradients through DDP
next to the padded pass of the unwrapped model."""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from grpo.learner import tree
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings, forward_is_collective
from support.layouts import batch_and_model, long_completions_batch


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    # each process's own micro-batch and tiny model: DDP starts every process from process 0's weights
    batch, model = (batch_and_model if rank == 0 else long_completions_batch)()
    cost = tree.pair_cost(model)
    alone = tree.cheaper(tree.layout(batch, pair_cost=cost), batch, True, cost)
    wrapped = DistributedDataParallel(model)
    assert forward_is_collective(wrapped) and not forward_is_collective(model)

    auto_settings = PassSettings(0.9, layouts=("shared_prefix", "trees"), by_cost=True)
    counts: Counter[str] = Counter()

    def scored(scorer, settings):
        model.zero_grad()
        out = token_logps(scorer, batch, settings)
        counts.update(out.layouts if settings.by_cost else ())
        (out.logps * batch.mask).sum().backward()
        m = batch.mask.bool()
        return out.logps[m].tolist(), out.entropies[m].tolist()

    auto = scored(wrapped, auto_settings)
    with torch.no_grad():  # the no-gradient passes agree as well
        counts.update(token_logps(wrapped, batch, auto_settings).layouts)
    padded = scored(model, PassSettings(0.9, layouts=("shared_prefix",)))
    result = {"alone_trees": alone, "laid_out": dict(counts), "auto": auto, "padded": padded}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
