"""packing="tree" against the padded layout, on the demo workload:

    python bench/tree_packing.py [bf16|fp32] [steps] [demo|story] [max_completion_length] [repeats]

(`story` with a longer cap: completions that all run to the cap, where nothing is padding and every group's tree
is as long as it gets.)

A short grpo run of the workload (bench/workload.py) keeps the micro-batches its training pass got; then each is
trained again in both layouts, alternately, `repeats` times (3; forward, the loss's sum, backward: the pass the trainer
times), on the run's final weights. Prints the positions and the attention's (query, key) pairs each layout
computes, and the training tokens/s of each:

    tree_positions_ratio=<tree / padded positions> tree_pairs_ratio=<tree / padded pairs>
    tree_train_speedup=<tree / padded training tokens/s>
    tree_train_speedup_checkpointing=<the same with gradient checkpointing, GRPOConfig's default>
    auto_train_speedup=<packing="auto" / padded> auto_train_speedup_checkpointing=<the same, checkpointing>

The padded layout is today's default (each prompt once through the shared KV cache, completions padded to the
micro-batch's longest); the tree lays out token trees of each prompt group, cut and packed into rows as its cost
model says (`grpo.learner.tree.layout`).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from workload import WORKLOAD, dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.learner import tree
from grpo.learner.forward import TrainingPass
from grpo.models.bundled import bundled_model_path

REPEATS = 3


def main() -> None:
    precision = sys.argv[1] if len(sys.argv) > 1 else "fp32"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    task = sys.argv[3] if len(sys.argv) > 3 else "demo"
    length = int(sys.argv[4]) if len(sys.argv) > 4 else WORKLOAD["max_completion_length"]
    repeats = int(sys.argv[5]) if len(sys.argv) > 5 else REPEATS
    prompts, reward = dataset(task)
    # the run that yields the micro-batches trains padded rows, so they are the same whatever packing's default
    overrides = dict(WORKLOAD, max_steps=steps, max_completion_length=length, packing="padded")
    args = GRPOConfig(output_dir="/tmp/grpo-bench-tree", bf16=precision == "bf16", disable_tqdm=True, **overrides)
    trainer = GRPOTrainer(model=bundled_model_path(), reward_funcs=reward, train_dataset=prompts, args=args)
    passes = trainer.training_pass
    kept = []
    train = passes.train

    def keeping(model, batch, entropy_grad):
        kept.append(batch)
        return train(model, batch, entropy_grad)

    passes.train = keeping
    trainer.train()
    passes.train = train
    model = trainer.model
    tokens = sum(int(b.completion_attention.sum()) for b in kept)
    # the padded pass as the workload runs it: each group's prompt once through the shared KV cache
    padded_shapes = [tree.padded_shape(b, shared=True) for b in kept]
    padded = sum(positions for positions, _ in padded_shapes)
    layouts = [tree.layout(b, pair_cost=tree.pair_cost(model)) for b in kept]  # as the training pass lays them out
    trees = sum(t.positions_computed for t in layouts)
    result = {
        "precision": precision,
        "task": task,
        "max_completion_length": length,
        "micro_batches": len(kept),
        "completion_tokens": tokens,
        "completion_padding_share": 1 - tokens / sum(len(b) * int(b.completion_attention.sum(-1).max()) for b in kept),
        "padded_positions": padded,
        "tree_positions": trees,
        "padded_pairs": sum(pairs for _, pairs in padded_shapes),
        "tree_pairs": sum(t.pairs_computed for t in layouts),
    }
    speedups = {}
    # as the workload runs (no gradient checkpointing: prompts shared through the KV cache, padding skipped by the
    # lean blocks' per-token modules), then with the trainer's default gradient checkpointing (neither applies)
    for setting in ("workload", "checkpointing"):
        if setting == "checkpointing":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            a = trainer.accelerator
            passes = TrainingPass(model, args, a.autocast, a.mixed_precision)
        seconds = timed_passes(model, passes, kept, repeats)
        for layout in LAYOUTS:
            result[f"{setting}_{layout}_tokens_per_s"] = tokens / seconds[layout]
        result[f"{setting}_auto_pieces_as_trees"] = f"{passes.laid_out['trees']}/{sum(passes.laid_out.values())}"
        speedups[setting] = {layout: seconds["padded"] / seconds[layout] for layout in ("tree", "auto")}
    print("TREE_RESULT " + json.dumps(result))
    print(
        f"tree_positions_ratio={trees / padded:.2f} "
        f"tree_pairs_ratio={result['tree_pairs'] / result['padded_pairs']:.2f} "
        f"tree_train_speedup={speedups['workload']['tree']:.2f} "
        f"tree_train_speedup_checkpointing={speedups['checkpointing']['tree']:.2f} "
        f"auto_train_speedup={speedups['workload']['auto']:.2f} "
        f"auto_train_speedup_checkpointing={speedups['checkpointing']['auto']:.2f} "
        f"({precision}, {task} to {length} tokens, {len(kept)} micro-batches, {tokens} completion tokens, "
        f"{result['completion_padding_share']:.0%} of padded completion positions are padding)"
    )


# each packing as TrainingPass's (trees among its layouts, by_cost)
LAYOUTS = {"padded": (False, False), "tree": (True, False), "auto": (True, True)}


def timed_passes(model, passes, kept, repeats: int) -> dict[str, float]:
    """Median seconds of the training pass over the kept micro-batches, per layout (`LAYOUTS`), alternating; the
    auto layout's pieces are counted in `passes.laid_out` (its last repeat's)."""
    seconds: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    rows = tuple(name for name in passes.layouts if name != "trees")  # the run's own, without trees
    for _ in range(repeats):
        for layout, (as_trees, by_cost) in LAYOUTS.items():
            passes.layouts, passes.by_cost = rows + ("trees",) * as_trees, by_cost
            passes.laid_out.clear()
            start = time.perf_counter()
            for batch in kept:
                logps = passes.train(model, batch, entropy_grad=False).logps
                (logps * batch.mask).sum().backward()
            seconds[layout].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    return {k: statistics.median(v) for k, v in seconds.items()}


if __name__ == "__main__":
    main()
