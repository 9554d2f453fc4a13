"""Image rows as token trees against padded rows: python bench/tree_images.py [repeats] [side] [architecture]

A random-weight Qwen2.5-VL (tests/support/vision.py's, at hidden 256 and 4 layers in the language model and the vision
tower; `architecture` "gemma3": a Gemma 3 of that size, its images pooled into 64 tokens that attend each other both
ways; "gemma4": a Gemma 4 of that size, its images resized to 384x384 (patches of 16) and pooled into 64 tokens that
attend each other both ways in its sliding layers, whatever `side`; "qwen3-vl": a Qwen3-VL of that size, patches of 16
pixels, 49 image tokens at 224), 2 prompts each with one image of `side` x `side` pixels (224: 64 image tokens), 8
completions per prompt of 16-96 random tokens. The training pass (forward, the loss's sum, backward; float32) over
that micro-batch in each layout, alternately, median of `repeats` (3). Padded rows run each row's prompt and image
(the pixel inputs go with each row); a tree holds a group's prompt and image once, so the vision tower computes each
prompt image once instead of once per completion. Prints:
    tree_images_positions_ratio=<tree / padded positions> tree_images_vision_ratio=<images the vision tower
    computes, tree / padded> tree_images_speedup=<padded pass seconds / tree pass seconds>

(and before them, the largest difference of a token's log-prob between the layouts, `max_logp_difference`).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from grpo import GRPOConfig  # noqa: E402
from grpo.learner import tree  # noqa: E402
from grpo.learner.forward import TrainingPass  # noqa: E402
from grpo.learner.tree_images import row_images  # noqa: E402
from grpo.models.vision import Pixels  # noqa: E402
from support.vision import gemma3, gemma4, image_batch, qwen3_vl, qwen_vl  # noqa: E402  (the tests' tiny models)

PROMPTS, G = 2, 8


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    side = int(sys.argv[2]) if len(sys.argv) > 2 else 224
    architecture = sys.argv[3] if len(sys.argv) > 3 else "qwen2.5-vl"
    if architecture == "gemma3":
        model, processor = gemma3(0, hidden=256, layers=4, side=side, tokens=64)
    elif architecture == "gemma4":
        model, processor = gemma4(0, hidden=256, layers=4, patch=16)
    elif architecture == "qwen3-vl":
        model, processor = qwen3_vl(0, hidden=256, layers=4, side=side)
    else:
        model, processor = qwen_vl(0, hidden=256, layers=4, side=side)
    batch = image_batch(processor, PROMPTS, G, side=side, lengths=(16, 97), text_only=0)
    args = GRPOConfig(output_dir="/tmp/grpo-bench-tree-images", packing="tree", report_to="none")
    passes = TrainingPass(model, args, contextlib.nullcontext, "no", pixels=Pixels.of(processor, model))
    assert passes.tree, "image rows should take trees here"
    images = passes.images
    assert images is not None
    marked = images.marks(batch)
    assert marked is not None
    trees = tree.layout(batch, pair_cost=tree.pair_cost(model), marks=marked.marks, run_layers=marked.run_layers)
    tree_images = sum(len(row) for row in row_images(images.pixels.token_types[0], trees, marked))
    seconds: dict[bool, list[float]] = {False: [], True: []}
    layouts = {True: passes.layouts, False: tuple(name for name in passes.layouts if name != "trees")}
    for _ in range(repeats):
        for as_trees in (False, True):
            passes.layouts = layouts[as_trees]
            start = time.perf_counter()
            logps = passes.train(model, batch, entropy_grad=False).logps
            (logps * batch.mask).sum().backward()
            seconds[as_trees].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    padded_s, tree_s = statistics.median(seconds[False]), statistics.median(seconds[True])
    scored = {}
    for as_trees in (False, True):  # the same numbers in both layouts (the tests' check, at this size)
        passes.layouts = layouts[as_trees]
        scored[as_trees] = passes.logps(model, batch)
    real = batch.completion_attention.bool()
    differ = float((scored[True] - scored[False])[real].abs().max())
    padded_positions = batch.prompt_ids.numel() + len(batch) * int(batch.completion_attention.sum(-1).max())
    result = {
        "architecture": architecture,
        "side": side,
        "rows": len(batch),
        "completion_tokens": int(batch.completion_attention.sum()),
        "padded_positions": padded_positions,
        "tree_positions": trees.positions_computed,
        "padded_images": len(batch),
        "tree_images": tree_images,
        "padded_s": padded_s,
        "tree_s": tree_s,
        "max_logp_difference": differ,
    }
    print("TREE_IMAGES_RESULT " + json.dumps(result))
    print(
        f"tree_images_positions_ratio={trees.positions_computed / padded_positions:.2f} "
        f"tree_images_vision_ratio={tree_images / len(batch):.2f} tree_images_speedup={padded_s / tree_s:.2f} "
        f"({architecture}, {PROMPTS} prompts with a {side}x{side} image, {G} completions each, float32)"
    )


if __name__ == "__main__":
    main()
