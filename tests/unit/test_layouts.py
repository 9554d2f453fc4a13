"""The table of training-pass layouts (`grpo.learner.layouts.LAYOUTS`): its entries, the layouts a run settles on,
and the layout `pick` gives each piece. That each layout scores as the padded rows do is in test_tree_packing,
test_shared_prefix_training and test_turn_layouts."""

from __future__ import annotations

import logging

import pytest
import torch

from grpo.learner import tree
from grpo.learner.layouts import LAYOUTS, PassSettings, RunFacts, TreeSetup, pick, settle
from support.layouts import batch_and_model, long_completions_batch, turns_batch


def test_each_layout_is_one_entry_with_its_reason_cost_and_forward():
    assert list(LAYOUTS) == ["padded", "shared_prefix", "forked", "trees"]
    assert all(callable(layout.unsupported_reason) and callable(layout.forward) for layout in LAYOUTS.values())
    assert LAYOUTS["forked"].cost is None  # a piece with turns takes trees wherever they hold it, else forked rows
    assert all(LAYOUTS[name].cost is not None for name in ("padded", "shared_prefix", "trees"))
    with pytest.raises(ValueError, match=r"Unknown layouts \['tree'\]"):
        PassSettings(layouts=("tree",))


def test_a_run_settles_on_the_layouts_its_model_takes(caplog):
    _, model = batch_and_model()
    assert settle(model, "padded", RunFacts()) == ("padded", "shared_prefix", "forked")
    assert settle(model, "auto", RunFacts()) == ("padded", "shared_prefix", "forked", "trees")
    with caplog.at_level(logging.INFO, logger="grpo"):
        assert settle(model, "auto", RunFacts(router_aux=True)) == ("padded", "forked")
    assert "runs each row's prompt itself: the router's load-balancing loss" in caplog.text
    assert "packing='auto' lays out padded rows: the router's load-balancing loss" in caplog.text
    with pytest.warns(UserWarning, match="packing='tree' is not used: a tree pass failed here"):
        failing = RunFacts(score=lambda batch, as_trees: 1 / 0 if as_trees else batch.mask)  # the tree probe's pass
        assert "trees" not in settle(model, "tree", failing)


def test_pick_lays_out_each_piece():
    batch, model = batch_and_model()
    setup = TreeSetup.of(model, torch.device("cpu"))
    assert pick(model, batch, PassSettings(), None).layout == "padded"
    shared = PassSettings(layouts=("shared_prefix",))
    assert pick(model, batch, shared, None).layout == "shared_prefix"
    router = PassSettings(layouts=("shared_prefix",), router_aux=True)  # over whole sequences
    assert pick(model, batch, router, None).layout == "padded"
    piece = pick(model, batch, PassSettings(layouts=("trees",)), setup)
    assert piece.layout == "trees" and piece.trees is not None
    # with the cost model, long even completions after a short prompt stay rows that share it
    long, _ = long_completions_batch()
    auto = PassSettings(layouts=("shared_prefix", "trees"), by_cost=True)
    assert pick(model, long, auto, setup).layout == "shared_prefix"
    assert pick(model, long, PassSettings(layouts=("trees",), by_cost=True), setup).layout == "trees"
    # rows with turns: trees wherever they hold the piece, else one row per turn
    turns, *_, turns_model = turns_batch()
    forked = pick(turns_model, turns, shared, None)
    assert forked.layout == "forked" and forked.rows == "shared_prefix" and forked.forked is not None
    assert pick(turns_model, turns, auto, TreeSetup.of(turns_model, torch.device("cpu"))).layout == "trees"
    narrow = TreeSetup(tree.pair_cost(turns_model), "dense", cap=1, collective=False)  # no tree that narrow
    assert pick(turns_model, turns, auto, narrow).layout == "forked"
