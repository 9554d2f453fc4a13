"""Multi-turn rows whose turns were sampled after rendered histories (`TrainBatch.turns`): every completion token is
scored after exactly its own turn's context. The training pass over them, as token trees (`packing="tree"`: each
distinct history once) and as one row per turn (the padded layout's forked rows), gives the log-probs, entropies and
gradients of the turns scored as separate single-turn rows (float32: rtol 1e-5; float64 to 1e-12), for every loss
type; and the tree computes far fewer positions than the forked rows."""

from __future__ import annotations

import pytest
import torch

from grpo.config.grpo_fields import LOSS_TYPES
from grpo.learner import tree
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings
from support.layouts import (
    GRAD_ATOL,
    assert_loss_types_gradients_agree,
    assert_same_pass,
    gathered,
    logps_and_grads,
    turns_batch,
)


def reference(model, batch, singles, where, dtype=torch.float32):
    lp, ent, grads, _ = logps_and_grads(model, singles)
    return gathered(lp, where, batch.mask.shape), gathered(ent.detach(), where, batch.mask.shape), grads


@pytest.mark.parametrize("as_trees", [True, False])
@pytest.mark.parametrize("chunked_head", [False, True])
def test_turns_score_like_separate_rows_as_trees_and_as_forked_rows(as_trees, chunked_head):
    batch, singles, where, order, model = turns_batch()
    expected = reference(model, batch, singles, where)
    got = logps_and_grads(model, batch, "trees" if as_trees else "padded", chunked_head=chunked_head)
    assert_same_pass(got, expected, batch, GRAD_ATOL)
    # the same in another row order and cut into pieces (pieces split groups)
    shuffled = batch.select(order)
    got = logps_and_grads(model, shuffled, "trees" if as_trees else "shared_prefix", chunk_size=4)
    assert_same_pass(got, tuple(x[order] for x in expected[:2]) + (expected[2],), shuffled, GRAD_ATOL)


def test_float64_turns_are_exact_to_rounding():
    batch, singles, where, _, model = turns_batch(seed=1)
    model = model.double()
    with torch.no_grad():
        single = token_logps(model, singles, PassSettings(1.0, with_entropy=False)).logps
        trees = token_logps(model, batch, PassSettings(1.0, with_entropy=False, layouts=("trees",))).logps
        forks = token_logps(model, batch, PassSettings(1.0, with_entropy=False)).logps
    expected, m = gathered(single, where, batch.mask.shape), batch.mask.bool()
    torch.testing.assert_close(trees[m], expected[m], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(forks[m], expected[m], rtol=1e-12, atol=1e-12)


def test_the_tree_holds_each_distinct_history_once():
    batch, singles, where, _, _ = turns_batch()
    trees = tree.layout(batch)
    # the tree's tokens are the distinct prefixes of the turns' sequences (context and tokens), per group
    distinct = {}
    for i, start, end, f in where:
        sequence = (
            singles.prompt_ids[f][singles.prompt_mask[f].bool()].tolist() + batch.completion_ids[i, start:end].tolist()
        )
        distinct.setdefault(int(batch.group[i]), set()).update(tuple(sequence[: k + 1]) for k in range(len(sequence)))
    assert sorted(trees.real.sum(-1).tolist()) == sorted(len(s) for s in distinct.values())
    forked_positions = int(singles.prompt_mask.sum() + singles.completion_attention.sum())
    assert int(trees.real.sum()) < 0.6 * forked_positions
    # positions follow each token's own context: a turn's first token sits at its context's length
    for i, start, end, f in where:
        if end - start > 1:
            assert trees.positions[trees.row[i, start + 1], trees.column[i, start + 1]] == int(
                singles.prompt_mask[f].sum()
            )


def test_a_group_wider_than_a_tree_is_cut_and_scores_the_same():
    batch, singles, where, _, model = turns_batch()
    with torch.no_grad():
        single = token_logps(model, singles, PassSettings(1.0, with_entropy=False)).logps
        widest = tree.longest(batch)
        assert len(tree.layout(batch, max_width=widest).input_ids) > len(batch.group.unique())
        tree.MAX_WIDTH, kept = widest, tree.MAX_WIDTH
        try:
            trees = token_logps(model, batch, PassSettings(1.0, with_entropy=False, layouts=("trees",))).logps
        finally:
            tree.MAX_WIDTH = kept
    m = batch.mask.bool()
    torch.testing.assert_close(trees[m], gathered(single, where, batch.mask.shape)[m], rtol=1e-5, atol=1e-6)


def test_a_truncated_row_masked_whole_and_a_window_count_the_turns():
    batch, _, _, _, model = turns_batch()
    longest = max(len(c) + e - s for row in batch.turns if row for s, e, c in row)
    assert tree.longest(batch) == longest
    model.config.sliding_window = longest - 1
    assert not tree.fits_window(model, batch)
    batch.completion_attention[0] = 0  # a truncated completion under mask_truncated_completions
    batch.mask[0] = 0
    expected = logps_and_grads(model, batch)  # forked rows (the window keeps the padded layout)
    model.config.sliding_window = None
    got = logps_and_grads(model, batch, "trees")
    assert_same_pass(got, expected, batch, GRAD_ATOL)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_types_gradient_through_turns_is_the_forked_rows(loss_type):
    """Each loss type's gradient (old log-probs moved off the policy, KL to a reference) from the tree equals the
    forked rows'."""
    batch, _, _, _, model = turns_batch(seed=2)
    assert_loss_types_gradients_agree(model, batch, loss_type, group=3, seed=3)
