"""Whether token trees give this model its padded numbers: a few tokens run both ways before training.

The tree pass (`grpo.learner.tree`) hands the model a prepared 4D mask and each token's position, and trusts the
model to attend and place tokens by them. Most models do (the family table in the tests checks 27), but a model may
place tokens by other means: ALiBi models (MPT, BLOOM) bias attention by each key's column, CPM-Ant and TrOCR's
decoder ignore the positions given, others fail on a 4D mask, and a model with remote code may do anything.
Trees would then train other numbers than the padded rows, silently, and `packing="auto"` is the CPU's default.
So before the first step, `mismatch` runs a tiny batch (two prompt groups of two ragged completions) as padded rows
and as trees, without gradient, in eval mode (no dropout), and returns why trees are not used where they disagree
or the tree pass fails; the padded rows train then. It costs two forwards of about 40 tokens.

Its trees are about 20 tokens wide, so it cannot see a window the model applies over the columns of its input (GPT-Neo's
local layers attend a band of `window_size` columns, whatever mask they are handed): a window of more columns than
the probe's trees masks nothing in them, and the run's wider trees would cross it. Windows are read from the config
instead, in every spelling transformers uses (`grpo.learner.windows`), and no tree the run lays out is wider than
one the model may apply over columns (`windows.window_cap`); a window the config does not name is found here only
where it is narrower than the probe's trees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from grpo.base.records import Rollout
from grpo.learner import tree_attention
from grpo.learner.batch import TrainBatch, collate
from grpo.learner.tree_attention import text_config
from grpo.models.modeling import unwrap

# the log-prob difference past which trees are taken to compute other numbers: float32 rounding is ~1e-6 here, a
# model that places tokens otherwise is off by 1e-2 or more; 16-bit weights round to ~1e-2 themselves
TOLERANCE = 1e-3  # float32 and float64 weights
LOW_PRECISION_TOLERANCE = 5e-2


def probe_batch(model: Any, device: torch.device) -> TrainBatch:
    """Two prompts (5 and 3 tokens) with two completions each (3 and 12, 2 and 8 tokens) of fixed random ids: the
    longer siblings sit between a prompt and the other completion in its tree."""
    inner = unwrap(model)
    vocab = getattr(inner.get_input_embeddings(), "num_embeddings", None) or text_config(model).vocab_size
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    scored = getattr(head, "out_features", None)  # (not its weight's shape: ZeRO-3 partitions that to 0 rows)
    if isinstance(scored, int) and scored > 0:
        vocab = min(vocab, scored)  # ids the head scores (CPM-Ant embeds more than it predicts)
    generator = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(1, max(vocab, 2), (n,), generator=generator).tolist()

    prompts = [ids(5), ids(3)]
    rows = [prompts[0], prompts[0], prompts[1], prompts[1]]
    completions = [ids(3), ids(12), ids(2), ids(8)]
    rollout = Rollout(
        prompt_ids=rows,
        completion_ids=completions,
        sampling_logps=[[0.0] * len(c) for c in completions],
        truncated=[False] * len(rows),
    )
    pad = getattr(inner.config, "pad_token_id", None)
    pad = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
    batch = collate(rollout, torch.zeros(len(rows)), pad, mask_truncated=False, group=torch.tensor([0, 0, 1, 1]))
    return batch.to(device)


def mismatch(model: Any, score: Callable[[TrainBatch, bool], torch.Tensor]) -> str | None:
    """Why the tree pass does not give `model` the padded pass's numbers (None: it does, or the padded pass itself
    fails here, which training then reports). `score(batch, as_trees)`: the pass's completion log-probs."""
    inner = unwrap(model)
    parameter = next((p for p in inner.parameters() if p.is_floating_point()), None)
    if parameter is None:
        return None
    try:
        batch = probe_batch(model, parameter.device)
    except Exception:  # noqa: BLE001 - a model without the usual embeddings: the tree pass is trusted, as before
        return None
    modes = [(module, module.training) for module in inner.modules()]  # each module's own (a frozen tower's eval)
    inner.eval()
    try:
        with torch.no_grad(), tree_attention.dense_kernel():
            try:
                padded = score(batch, False)
            except Exception:  # noqa: BLE001 - not a tree question: the padded pass reports it in training
                return None
            try:
                trees = score(batch, True)
            except Exception as error:  # noqa: BLE001 - any failure of the tree pass means padded rows
                return f"a tree pass failed here ({type(error).__name__}: {str(error)[:200]})"
    finally:
        for module, training in modes:
            module.training = training
    real = batch.mask.bool()
    difference = float((trees[real].float() - padded[real].float()).abs().max())
    tolerance = TOLERANCE if parameter.dtype in (torch.float32, torch.float64) else LOW_PRECISION_TOLERANCE
    if not difference <= tolerance:  # NaN too
        return (
            f"its log-probs as token trees differ from its padded rows by {difference:.3g} on a probe of a few "
            "tokens: the model does not attend or place tokens only by the mask and positions a tree gives it "
            "(ALiBi, positions of its own)"
        )
    return None
