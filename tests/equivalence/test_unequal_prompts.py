"""Rows of one group (`TrainBatch.group`: a dataset row's G samples) share a prompt in the training pass only where
their prompt tokens are equal. A rollout_func returns prompt_ids per sample and may give a group's samples
different ones (a per-sample hint); the padded pass that shares each group's prompt through a KV cache ran the
group's first prompt for every row, 0.21 off the policy's own log-probs, under packing="padded" and "auto"."""

from __future__ import annotations

import pytest
import torch

from grpo.base.records import Rollout
from grpo.learner import tree
from grpo.learner.batch import collate
from grpo.learner.prefix import shared_prompts
from support.layouts import assert_same_pass, logps_and_grads
from support.tiny import make_model, make_tokenizer


def hinted_batch(seed: int = 0):
    """Two groups of four samples, each sample's prompt its group's question and a hint of its own (ragged: 0 to 5
    tokens, two samples of group 0 with the same hint, one without), the rows shuffled; and a tiny model."""
    tok = make_tokenizer()
    model = make_model(tok, hidden=64)
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(10, len(tok), (n,), generator=g).tolist()

    questions = [ids(9), ids(6)]
    hints = [[ids(3), ids(3), [], ids(5)], [ids(2), ids(4), ids(1), ids(3)]]
    hints[0][1] = hints[0][0]  # two samples with the same prompt: they share it
    rows, completions, group = [], [], []
    for k, question in enumerate(questions):
        for hint in hints[k]:
            rows.append(question + hint)
            completions.append(ids(int(torch.randint(2, 9, (1,), generator=g))))
            group.append(k)
    rollout = Rollout(
        prompt_ids=rows,
        completion_ids=completions,
        sampling_logps=[[0.0] * len(c) for c in completions],
        truncated=[False] * len(rows),
    )
    batch = collate(rollout, torch.zeros(len(rows)), tok.pad_token_id, mask_truncated=False, group=torch.tensor(group))
    return batch.select(torch.randperm(len(rows), generator=g)), model


def test_rows_share_a_prompt_only_where_its_tokens_are_equal():
    batch, _ = hinted_batch()
    first, inverse = shared_prompts(batch)
    assert len(first) == 7  # eight samples, two of them with the same hint
    for i in range(len(batch)):
        j = int(first[inverse[i]])
        assert torch.equal(batch.prompt_ids[i], batch.prompt_ids[j]) and int(batch.group[i]) == int(batch.group[j])
    # the padded layout's cost (packing="auto") counts each distinct prompt once
    rows, prompt = batch.prompt_ids.shape
    width = int(batch.completion_attention.sum(-1).max())
    assert tree.padded_shape(batch, shared=True)[0] == 7 * prompt + rows * width


def test_the_shared_prompt_pass_scores_each_row_after_its_own_prompt():
    """The KV-cache pass gave the group's first prompt to every row: 0.21 off the plain pass; now its log-probs,
    entropies and gradients are the plain pass's."""
    batch, model = hinted_batch()
    plain = logps_and_grads(model, batch)
    shared = logps_and_grads(model, batch, "shared_prefix")
    assert_same_pass(shared, plain, batch)


@pytest.mark.parametrize("by_cost", [False, True])
def test_trees_merge_only_equal_prompt_tokens(by_cost):
    """packing="tree" (and "auto", each piece as the cheaper layout) builds each group's trie from the tokens: the
    samples' different prompts branch where they differ, and every row is scored after its own prompt."""
    batch, model = hinted_batch()
    plain = logps_and_grads(model, batch)
    trees = logps_and_grads(model, batch, "trees", "shared_prefix", by_cost=by_cost)
    assert_same_pass(trees, plain, batch)
    if not by_cost:
        assert trees.layouts == ("trees",)
