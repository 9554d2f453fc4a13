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
from grpo.learner.batch import collate
from grpo.learner.forward import token_logps
from grpo.rollout.base import Rollout
from support.tiny import make_model, make_tokenizer
from test_shared_prefix_training import assert_same_pass, logps_and_grads
from test_tree_packing import GRAD_ATOL, assert_loss_types_gradients_agree


def turns_batch(seed=0):
    """Two groups of three rows, each row up to three turns. A later turn's context is the earlier one's with its
    first sampled tokens dropped (a stripped reasoning block) and tool tokens after (a rendered tool turn), or the
    earlier context and tokens continued as they are; one row is a single turn. Also the turns as separate
    single-turn rows (prompt = context), and where each of the batch's positions sits among them."""
    tok = make_tokenizer()
    g = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(10, len(tok), (n,), generator=g).tolist()

    prompts = [tokens(6), tokens(9)]
    rows, completions, turns, group = [], [], [], []
    for k, prompt in enumerate(prompts):
        for r in range(3):
            spans = [tokens(int(torch.randint(2, 7, (1,), generator=g))) for _ in range(1 if r == 2 else 3)]
            context, start, done = list(prompt), 0, []
            for t, span in enumerate(spans):
                done.append((start, start + len(span), tuple(context)))
                start += len(span)
                # the next turn's history: this turn stripped of its first two tokens, or kept (r == 1, t == 0)
                kept = span if (r == 1 and t == 0) else span[2:]
                context = context + kept + tokens(3)
            rows.append(prompt)
            completions.append([x for span in spans for x in span])
            turns.append(tuple(done) if len(done) > 1 else None)
            group.append(k)
    rollout = Rollout(
        prompt_ids=rows,
        completion_ids=completions,
        sampling_logps=[[0.0] * len(c) for c in completions],
        truncated=[False] * len(rows),
        turns=turns,
    )
    batch = collate(rollout, torch.zeros(len(rows)), tok.pad_token_id, mask_truncated=False, group=torch.tensor(group))
    # the reference: each turn a row of its own
    forks, where = [], []
    for i in range(len(rows)):
        for start, end, context in turns[i] or ((0, len(completions[i]), tuple(rows[i])),):
            where.append((i, start, end, len(forks)))
            forks.append((list(context), completions[i][start:end]))
    single = Rollout(
        prompt_ids=[c for c, _ in forks],
        completion_ids=[s for _, s in forks],
        sampling_logps=[[0.0] * len(s) for _, s in forks],
        truncated=[False] * len(forks),
    )
    singles = collate(single, torch.zeros(len(forks)), tok.pad_token_id, mask_truncated=False)
    order = torch.randperm(len(rows), generator=g)
    return batch, singles, where, order, make_model(tok, hidden=64)


def gathered(values, where, shape):
    """The single-turn rows' per-token values at the batch's positions."""
    out = torch.zeros(shape, dtype=values.dtype)
    for i, start, end, f in where:
        out[i, start:end] = values[f, : end - start]
    return out


def reference(model, batch, singles, where, dtype=torch.float32):
    lp, ent, grads = logps_and_grads(model, singles)
    return gathered(lp, where, batch.mask.shape), gathered(ent.detach(), where, batch.mask.shape), grads


@pytest.mark.parametrize("as_trees", [True, False])
@pytest.mark.parametrize("chunked_head", [False, True])
def test_turns_score_like_separate_rows_as_trees_and_as_forked_rows(as_trees, chunked_head):
    batch, singles, where, order, model = turns_batch()
    expected = reference(model, batch, singles, where)
    got = logps_and_grads(model, batch, chunked_head=chunked_head, as_trees=as_trees)
    assert_same_pass(got, expected, batch, GRAD_ATOL)
    # the same in another row order and cut into pieces (pieces split groups)
    shuffled = batch.select(order)
    got = logps_and_grads(model, shuffled, as_trees=as_trees, chunk_size=4, share_prefix=not as_trees)
    assert_same_pass(got, tuple(x[order] for x in expected[:2]) + (expected[2],), shuffled, GRAD_ATOL)


def test_float64_turns_are_exact_to_rounding():
    batch, singles, where, _, model = turns_batch(seed=1)
    model = model.double()
    with torch.no_grad():
        single, _ = token_logps(model, singles, 1.0, with_entropy=False)
        trees, _ = token_logps(model, batch, 1.0, with_entropy=False, as_trees=True)
        forks, _ = token_logps(model, batch, 1.0, with_entropy=False)
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
        single, _ = token_logps(model, singles, 1.0, with_entropy=False)
        widest = tree.longest(batch)
        assert len(tree.layout(batch, max_width=widest).input_ids) > len(batch.group.unique())
        tree.MAX_WIDTH, kept = widest, tree.MAX_WIDTH
        try:
            trees, _ = token_logps(model, batch, 1.0, with_entropy=False, as_trees=True)
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
    got = logps_and_grads(model, batch, as_trees=True)
    assert_same_pass(got, expected, batch, GRAD_ATOL)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_types_gradient_through_turns_is_the_forked_rows(loss_type):
    """Each loss type's gradient (old log-probs moved off the policy, KL to a reference) from the tree equals the
    forked rows'."""
    batch, _, _, _, model = turns_batch(seed=2)
    assert_loss_types_gradients_agree(model, batch, loss_type, group=3, seed=3)
