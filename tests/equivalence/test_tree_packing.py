"""`packing="tree"`: the training pass over one token tree per prompt group gives the padded pass's log-probs,
entropies and gradients (float32: rtol 1e-5 / atol 1e-6), with ragged prompts, ragged and empty completions,
shuffled rows, both attention implementations, the tiled and the full output head, and rows cut into pieces; and
it computes fewer positions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from grpo.config.grpo_fields import LOSS_TYPES
from grpo.learner import tree, tree_attention
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings
from support import on_device
from support.layouts import (
    GRAD_ATOL,
    allowed_pairs,
    assert_loss_types_gradients_agree,
    assert_same_pass,
    batch_and_model,
    dense_twin,
    logps_and_grads,
    long_completions_batch,
    turns_batch,
)
from support.tiny import make_model, make_tokenizer


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("chunked_head", [False, True])
def test_tree_pass_matches_the_padded_pass(attention, chunked_head):
    batch, model = batch_and_model()
    model.config._attn_implementation = attention
    padded = logps_and_grads(model, batch, chunked_head=chunked_head)
    trees = logps_and_grads(model, batch, "trees", chunked_head=chunked_head)
    assert_same_pass(trees, padded, batch, GRAD_ATOL)
    assert any(g.abs().sum() > 0 for g in trees[2].values())


def test_tree_pass_in_pieces_and_with_an_empty_completion():
    batch, model = batch_and_model()
    batch.completion_attention[3] = 0  # a row masked whole (a truncated completion under mask_truncated_completions)
    batch.mask[3] = 0
    padded = logps_and_grads(model, batch, "shared_prefix")
    trees = logps_and_grads(model, batch, "trees", chunk_size=5)  # pieces split groups
    assert_same_pass(trees, padded, batch, GRAD_ATOL)


def test_the_layout_holds_each_prompt_once_and_no_padding_inside_a_group():
    batch, _ = batch_and_model()
    trees = tree.layout(batch)  # no cost on pairs: one tree per group, the fewest tokens
    prompts = {g: int(batch.prompt_mask[batch.group == g][0].sum()) for g in batch.group.unique().tolist()}
    # a group's tree holds each distinct prefix of its rows' sequences once: the prompt, then each completion's
    # tokens (completions that begin alike share those tokens too)
    per_group: dict[int, set] = {}
    for i in range(len(batch)):
        n = int(batch.completion_attention[i].sum())
        sequence = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist() + batch.completion_ids[i, :n].tolist()
        per_group.setdefault(int(batch.group[i]), set()).update(tuple(sequence[: k + 1]) for k in range(len(sequence)))
    sizes = {g: len(prefixes) for g, prefixes in per_group.items()}
    assert all(sizes[g] <= prompts[g] + int(batch.completion_attention[batch.group == g].sum()) for g in sizes)
    assert int(trees.real.sum()) == sum(sizes.values())
    assert trees.input_ids.shape[1] == max(sizes.values()) and len(trees.input_ids) <= len(sizes)
    assert trees.positions_computed < batch.prompt_ids.numel() + batch.completion_ids.numel()
    # a completion's first token sits at its prompt's length, as in the padded pass (the output at column[i, 1]
    # predicts token 1, so it is token 0's)
    for i in range(len(batch)):
        if batch.completion_attention[i].sum() > 1:
            assert trees.positions[trees.row[i, 0], trees.column[i, 1]] == prompts[int(batch.group[i])]


def test_a_group_longer_than_the_widest_tree_is_cut_into_trees():
    batch, model = batch_and_model()
    widest = int((batch.prompt_mask.sum(-1) + batch.completion_attention.sum(-1)).max())
    groups = len(batch.group.unique())
    trees = tree.layout(batch, max_width=widest)  # no tree wider than the longest row
    assert trees.input_ids.shape[1] == widest and groups < len(trees.input_ids) < len(batch)
    assert len(tree.layout(batch, max_width=10**6).input_ids) == groups
    with torch.no_grad():
        padded = token_logps(model, batch, PassSettings(1.0, with_entropy=False)).logps
        tree.MAX_WIDTH, kept = widest + 3, tree.MAX_WIDTH  # trees of one or two completions
        try:
            trees_lp = token_logps(model, batch, PassSettings(1.0, with_entropy=False, layouts=("trees",))).logps
        finally:
            tree.MAX_WIDTH = kept
    m = batch.mask.bool()
    torch.testing.assert_close(trees_lp[m], padded[m], rtol=1e-5, atol=1e-6)


def test_small_trees_share_a_row(monkeypatch):
    """Trees narrower than the widest sit side by side in one row, each attending only within itself: the pass
    is the padded one's."""
    batch, model = batch_and_model()
    group = batch.group.tolist()
    keep = [i for i, g in enumerate(group) if g == 1] + [group.index(0), group.index(2)]  # 4 rows, then 1 and 1
    batch = batch.select(torch.tensor(keep))
    trees = tree.layout(batch)
    assert len(trees.input_ids) == 2 and sorted(trees.real.sum(-1).tolist())[0] < trees.input_ids.shape[1]
    two = int(trees.real[trees.row[-1, 0]].sum())  # the two one-row groups' trees, side by side
    assert trees.row[-1, 0] == trees.row[-2, 0] and two == sum(
        int(batch.prompt_mask[i].sum() + batch.completion_attention[i].sum()) for i in (-1, -2)
    )
    monkeypatch.setattr(tree, "pair_cost", lambda model: 0.0)  # the training pass lays out these rows
    padded = logps_and_grads(model, batch)
    packed = logps_and_grads(model, batch, "trees")
    assert_same_pass(packed, padded, batch, GRAD_ATOL)


def test_the_cost_model_cuts_groups_where_width_costs_more_than_repeated_prompts(monkeypatch):
    """Each layout is the cheaper of the two for its cost on pairs: with none, one tree per group (each prompt
    once); with pairs as dear as tokens, narrower trees (each prompt more than once, fewer pairs). The pass over
    the narrow layout is the padded one's."""
    batch, model = long_completions_batch()
    wide, narrow = tree.layout(batch), tree.layout(batch, pair_cost=1.0)

    def cost(trees, pair_cost):
        return int(trees.real.sum()) + pair_cost * trees.pairs_computed

    assert len(wide.input_ids) == 3 and len(narrow.input_ids) > 3
    assert int(narrow.real.sum()) > int(wide.real.sum()) and narrow.pairs_computed < wide.pairs_computed
    assert cost(wide, 0.0) < cost(narrow, 0.0) and cost(narrow, 1.0) < cost(wide, 1.0)
    monkeypatch.setattr(tree, "pair_cost", lambda model: 1.0)
    padded = logps_and_grads(model, batch)
    trees = logps_and_grads(model, batch, "trees")
    assert_same_pass(trees, padded, batch, GRAD_ATOL)


def test_by_cost_takes_trees_only_where_they_cost_less_than_padded_rows():
    """`packing="auto"`'s choice per piece (`by_cost`): ragged completions after long prompts run as trees;
    four completions of 30-40 tokens after a short prompt cost less as padded rows sharing the prompt (each padded
    row attends over its own ~60 positions, a tree over ~200), and as trees where the prompt is not shared (rows of
    prompt and completion each). Either way the padded pass's numbers."""
    ragged, model = batch_and_model()
    long, _ = long_completions_batch()
    cost = tree.pair_cost(model)
    assert tree.cheaper(tree.layout(ragged, pair_cost=cost), ragged, True, cost)
    assert not tree.cheaper(tree.layout(long, pair_cost=cost), long, True, cost)
    assert tree.cheaper(tree.layout(long, pair_cost=cost), long, False, cost)
    for batch, shared, laid in ((ragged, True, "trees"), (long, True, "shared_prefix"), (long, False, "trees")):
        rows = "shared_prefix" if shared else "padded"
        padded = logps_and_grads(model, batch, rows)
        chosen = logps_and_grads(model, batch, rows, "trees", by_cost=True)
        assert chosen.layouts == (laid,), (shared, chosen.layouts)
        assert_same_pass(chosen, padded, batch, GRAD_ATOL)


@on_device.mark
@pytest.mark.parametrize("make", [batch_and_model, long_completions_batch], ids=["ragged", "long"])
def test_tree_and_auto_passes_are_the_padded_pass_on_the_tests_device(make, monkeypatch):
    """On the tests' device (on CUDA: FlexAttention's block-sparse kernel, which must run there, and SDPA with the
    tree's dense boolean mask), the tree pass as the cost model cuts and packs it, a narrower cut (pairs as dear as
    tokens) and packing="auto"'s choice each give the padded pass's log-probs, entropies and gradients, at that
    device's float32 tolerance."""
    batch, model = make()
    device = on_device.device()
    batch, model = batch.to(device), model.to(device)
    tolerance = on_device.float32_tolerance()
    grad_tolerance = dict(rtol=tolerance["rtol"], atol=max(GRAD_ATOL, tolerance["atol"]))

    padded = logps_and_grads(model, batch, "shared_prefix")
    kernel = tree_attention.attention_kernel(model, device)
    assert kernel == ("flex" if device.type == "cuda" else "dense")
    runs = {
        "tree": logps_and_grads(model, batch, "trees"),
        "auto": logps_and_grads(model, batch, "trees", "shared_prefix", by_cost=True),
    }
    if kernel == "flex":
        monkeypatch.setattr(tree_attention, "FORCE_KERNEL", "dense")
        runs["tree, dense mask"] = logps_and_grads(model, batch, "trees")
    monkeypatch.setattr(tree, "pair_cost", lambda model: 1.0)
    runs["narrow"] = logps_and_grads(model, batch, "trees")  # the dense mask's cut: the narrowest trees
    m = batch.mask.bool()
    for name, (logps, entropies, grads, _) in runs.items():
        torch.testing.assert_close(logps[m], padded[0][m], **tolerance, msg=name)
        torch.testing.assert_close(entropies[m], padded[1][m], **tolerance, msg=name)
        for parameter, grad in padded[2].items():
            torch.testing.assert_close(grads[parameter], grad, **grad_tolerance, msg=f"{name}: {parameter}")


def test_pair_cost_reads_the_models_shape():
    """SmolLM2-135M's shape (grouped-query attention, a gated MLP): 2 x 576 multiply-adds per pair against
    2 x 576 x 576 (q, o) + 2 x 576 x 192 (k, v) + 3 x 576 x 1536 (the MLP) per token."""
    config = LlamaConfig(
        hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536
    )
    expected = 2 * 576 / (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
    assert tree.pair_cost(SimpleNamespace(config=config)) == pytest.approx(expected)
    assert tree.PAIR_COST == pytest.approx(expected, rel=0.05)  # the default where a config does not say
    assert tree.pair_cost(SimpleNamespace(config=SimpleNamespace())) == tree.PAIR_COST


def gemma4_text_config():
    """A 3-layer Gemma 4 language model's config: two sliding layers with heads of 16 over 2 key-value heads, and a
    global one with heads of 32 over 1 key-value head whose keys are its values (per-layer configs, as Gemma 4's
    larger models), per-layer inputs of 4, a vocabulary of 32."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        hidden_size_per_layer_input=4,
        vocab_size_per_layer_input=32,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )


def test_layers_of_two_shapes_are_each_counted():
    """Gemma 4's global layers have wider heads (and here fewer key-value heads) than its sliding ones, a per-layer
    config whose global `head_dim` transformers refuses to read: each layer's shape is read from its own config, by
    the tree's cost model, the FlexAttention probe (`attention_shapes`) and vLLM's KV-cache size."""
    from grpo.models.modeling import attention_shapes
    from grpo.rollout.vllm import kv_cache_bytes

    config = gemma4_text_config()
    assert attention_shapes(config) == [(4, 2, 16), (4, 2, 16), (4, 1, 32)]
    per_token = [2 * 64 * 4 * head + 2 * 64 * kv * head + 3 * 64 * 128 for _, kv, head in attention_shapes(config)]
    expected = (2 * 4 * 16 * 2 + 2 * 4 * 32) / sum(per_token)
    assert tree.pair_cost(SimpleNamespace(config=config)) == pytest.approx(expected)
    keys_and_values = 2 * (2 * 16 + 2 * 16 + 1 * 32) * 4  # float32 bytes a token holds, over the three layers
    assert kv_cache_bytes(config, torch.float32, 1, 1, 1000) == keys_and_values * (1000 + 256)
    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    assert attention_shapes(llama) == [(4, 2, 16)] * 3


def test_a_row_past_the_sliding_window_keeps_the_padded_layout():
    batch, model = batch_and_model()
    model.config.sliding_window = 4  # shorter than every row: the tree's mask would drop the window
    assert not tree.fits_window(model, batch)
    model.config.sliding_window = 4096
    assert tree.fits_window(model, batch)


def test_models_whose_attention_takes_no_prepared_mask_are_named():
    model = make_model(make_tokenizer())
    model.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in tree.unsupported_reason(model)
    model.config._attn_implementation = "sdpa"
    assert tree.unsupported_reason(model) is None


def test_float64_tree_pass_is_exact_to_rounding():
    batch, model = batch_and_model()
    model = model.double()
    with torch.no_grad():
        padded = token_logps(model, batch, PassSettings(1.0, with_entropy=False)).logps
        trees = token_logps(model, batch, PassSettings(1.0, with_entropy=False, layouts=("trees",))).logps
    m = batch.mask.bool()
    torch.testing.assert_close(trees[m], padded[m], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_types_gradient_is_the_padded_one(loss_type):
    """Each loss type's gradient through the tree pass equals the padded pass's: off-policy (old log-probs moved
    away), a KL term against a reference, the entropies the losses read."""
    batch, model = batch_and_model()
    assert_loss_types_gradients_agree(model, batch, loss_type, group=4)


def block_mask_pairs(trees):
    """Where FlexAttention's block mask of `trees` lets each query attend each key: (R, T, T)."""
    return allowed_pairs(tree_attention.block_mask(trees.first, trees.last), *trees.last.shape)


def test_the_flex_block_mask_attends_as_the_dense_mask_and_its_blocks_are_counted(monkeypatch):
    """FlexAttention's block mask (the "flex" kernel) allows exactly the dense mask's (query, key) pairs, for one
    tree per group, groups cut into trees side by side, and rendered turns (hidden branches); and `flex_blocks`
    counts the blocks it computes (blocks of 16 here, so these rows have several)."""
    monkeypatch.setattr(tree_attention, "FLEX_BLOCK", 16)
    batch, _ = batch_and_model()
    turns, *_ = turns_batch()
    widest = int((batch.prompt_mask.sum(-1) + batch.completion_attention.sum(-1)).max())
    for trees in (tree.layout(batch), tree.layout(batch, max_width=widest), tree.layout(turns)):
        dense = trees.mask[:, 0]
        assert torch.equal(block_mask_pairs(trees), dense)
        flex_mask = tree_attention.block_mask(trees.first, trees.last)
        assert tree_attention.flex_blocks(trees.first, trees.last) == int(flex_mask.to_dense().sum())
        # every key a query attends is itself or an ancestor: at a smaller position, and never padding
        rows, queries, keys = dense.nonzero(as_tuple=True)
        assert bool((trees.positions[rows, keys] <= trees.positions[rows, queries]).all())
        assert bool((trees.real[rows, keys].bool() | (keys == queries)).all())
    # pairs cost FlexAttention no cut: one tree per group, whatever the cost of pairs
    flex = tree.layout(batch, pair_cost=1.0, kernel="flex")
    assert torch.equal(flex.input_ids, tree.layout(batch).input_ids) and flex.kernel == "flex"
    assert flex.pairs_computed == tree_attention.flex_blocks(flex.first, flex.last) * 16**2


def run_marks(batch, length=4, short=()):
    """For each row, prompt tokens 2..2+length-1 marked as one run (an "image" per group), the rest unmarked; rows in
    `short` mark one token fewer."""
    marks = []
    for i in range(len(batch)):
        n = int(batch.prompt_mask[i].sum() + batch.completion_attention[i].sum())
        row = [None] * n
        for k in range(length - (i in short)):
            row[2 + k] = (int(batch.group[i]), k)
        marks.append(row)
    return marks


GEMMA3_LAYERS = ("full_attention", "sliding_attention")  # the layers where Gemma 3's image runs attend both ways


def test_runs_of_marked_tokens_attend_each_other_both_ways(monkeypatch):
    """With `run_layers` (a model whose image tokens attend each other both ways, Gemma 3), each run of marked tokens
    also attends its later tokens, and nothing else changes: a group's run is one chain in its tree. FlexAttention's
    block mask allows the same pairs and `flex_blocks` counts its blocks. A run that would branch in a tree (one row's
    run ending where another's goes on) is refused."""
    monkeypatch.setattr(tree_attention, "FLEX_BLOCK", 16)
    batch, _ = batch_and_model()
    marks = run_marks(batch)
    causal = tree.layout(batch, marks=marks)
    both = tree.layout(batch, marks=marks, run_layers=GEMMA3_LAYERS)
    assert torch.equal(causal.input_ids, both.input_ids) and torch.equal(causal.last, both.last)
    extra = both.mask & ~causal.mask
    assert bool((causal.mask <= both.mask).all())
    groups = len(batch.group.unique())
    assert int(extra.sum()) == groups * 6  # a run of 4 tokens per group tree: 6 (earlier, later) pairs each
    rows, _, queries, keys = extra.nonzero(as_tuple=True)
    assert bool((keys > queries).all())
    assert bool((both.positions[rows, queries] >= 2).all()) and bool((both.positions[rows, keys] <= 5).all())
    assert torch.equal(block_mask_pairs(both), both.mask[:, 0])
    flex_mask = tree_attention.block_mask(both.first, both.last)
    assert tree_attention.flex_blocks(both.first, both.last) == int(flex_mask.to_dense().sum())
    first_of_group = {}
    for i, g in enumerate(batch.group.tolist()):
        first_of_group.setdefault(g, i)
    with pytest.raises(ValueError, match="branches"):
        tree.layout(batch, marks=run_marks(batch, short={first_of_group[0]}), run_layers=GEMMA3_LAYERS)
    tree.layout(batch, marks=run_marks(batch, short={first_of_group[0]}))  # causal: a branch as any other


def test_the_tree_attends_with_flex_attention_on_cuda_where_it_runs(monkeypatch):
    """The "flex" kernel is taken for an SDPA model on CUDA, where the probe runs the model's attention shape;
    the dense mask on the CPU (FlexAttention has no backward there), for eager attention, under attention
    dropout while training, and where the probe fails. No GPU is needed: the probe is replaced."""
    _, model = batch_and_model()
    probed = []
    runs = {"ok": True}
    monkeypatch.setattr(
        tree_attention, "_flex_runs", lambda device, dtype, shape: probed.append((dtype, shape)) or runs["ok"]
    )
    cuda = torch.device("cuda")
    assert tree_attention.attention_kernel(model, torch.device("cpu")) == "dense" and not probed
    assert tree_attention.attention_kernel(model, cuda) == "flex"
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert probed == [(torch.float32, (config.num_attention_heads, config.num_key_value_heads, head_dim))]
    config._attn_implementation = "eager"
    assert tree_attention.attention_kernel(model, cuda) == "dense"
    config._attn_implementation, config.attention_dropout = "sdpa", 0.1
    assert tree_attention.attention_kernel(model.train(), cuda) == "dense"
    assert tree_attention.attention_kernel(model.eval(), cuda) == "flex"  # dropout is off out of training
    runs["ok"] = False
    assert tree_attention.attention_kernel(model, cuda) == "dense"


def test_a_flex_attention_that_does_not_run_is_named_once_and_the_dense_mask_used(monkeypatch):
    """The probe on the CPU (no FlexAttention backward there) fails: one warning names why, and the answer is kept."""
    monkeypatch.setattr(tree_attention, "_FLEX_RUNS", {})
    with pytest.warns(UserWarning, match="FlexAttention does not run here.*backward"):
        assert not tree_attention._flex_runs(torch.device("cpu"), torch.float32, (2, 1, 16))
    assert not tree_attention._flex_runs(torch.device("cpu"), torch.float32, (2, 1, 16))  # asked again: no second probe


def test_the_flex_probe_runs_each_head_shape_and_a_changed_width(monkeypatch):
    """A model whose layers have two head shapes (Gemma 4's global layers are wider) is probed with each; each probe
    runs two more shapes, two rows and one of a width no block divides (torch.compile recompiles for changing
    shapes there), and a kernel that fails only there gives the dense mask, with one warning."""
    from transformers import Gemma4ForCausalLM

    model = Gemma4ForCausalLM(gemma4_text_config())
    probes = []

    def probe(device, dtype, shape, rows, width):
        probes.append((shape, rows, width))
        if fails and rows > 1:
            raise RuntimeError("the recompiled kernel does not build")

    monkeypatch.setattr(tree_attention, "_probe", probe)
    monkeypatch.setattr(tree_attention, "_route_block_masks", lambda: None)
    monkeypatch.setattr(tree_attention, "_FLEX_RUNS", {})
    fails = False
    assert tree_attention.attention_kernel(model, torch.device("cuda")) == "flex"
    block = tree_attention.FLEX_BLOCK
    shapes = [(1, 2 * block), (2, 3 * block - 5), (1, 3 * block - 5)]
    assert probes == [((4, 2, 16), *shape) for shape in shapes] + [((4, 1, 32), *shape) for shape in shapes]
    monkeypatch.setattr(tree_attention, "_FLEX_RUNS", {})
    fails = True
    with pytest.warns(UserWarning, match="FlexAttention does not run here.*recompiled kernel"):
        assert tree_attention.attention_kernel(model, torch.device("cuda")) == "dense"


def test_routing_block_masks_leaves_sdpa_as_it_was():
    """With block masks routed to FlexAttention, every other SDPA call is the same: the padded pass's numbers
    are unchanged, bit for bit."""
    batch, model = batch_and_model()
    before = logps_and_grads(model, batch, "shared_prefix")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    tree_attention._route_block_masks()
    routed = ALL_ATTENTION_FUNCTIONS["sdpa"]
    tree_attention._route_block_masks()  # once per process: a second call changes nothing
    assert routed.routes_block_masks and ALL_ATTENTION_FUNCTIONS["sdpa"] is routed
    after = logps_and_grads(model, batch, "shared_prefix")
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    assert all(torch.equal(after[2][name], grad) for name, grad in before[2].items())


def test_packing_none_is_auto_on_the_cpu_and_padded_elsewhere():
    """packing=None (the default): "auto" for a model on the CPU, where it was measured at least as fast as padded
    rows everywhere; "padded" on any other device until measured there."""
    _, model = batch_and_model()
    assert tree.default_packing(model) == "auto"
    assert tree.default_packing(model.to("meta")) == "padded"


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_block_masks_reach_the_attention_in_forward_and_in_recomputation(monkeypatch, checkpointing):
    """The "flex" kernel's plumbing, forward and backward, on the CPU: each layer's SDPA attention gets the tree's
    block mask through transformers' mask handling and hands it to the FlexAttention function, also in the forward
    that gradient checkpointing re-runs during backward; log-probs, entropies and gradients are the padded pass's.
    FlexAttention itself has no backward on the CPU, so a dense twin stands in for it here (the block mask's own
    rule, attended by SDPA); the GPU check runs the real kernel on CUDA. The pass's forward runs with
    torch.compile's recompile limit raised (`tree_attention.compiles`), and leaves it as it was."""
    import torch._dynamo

    calls, limits = [], []
    limit = torch._dynamo.config.recompile_limit

    def counted_twin(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        limits.append(torch._dynamo.config.recompile_limit)
        return dense_twin(*args, **kwargs)

    monkeypatch.setattr(tree_attention, "_flex_attention", counted_twin)
    monkeypatch.setattr(tree_attention, "FORCE_KERNEL", "flex")
    batch, model = batch_and_model()
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    padded = logps_and_grads(model, batch)
    flex = logps_and_grads(model, batch, "trees")
    assert_same_pass(flex, padded, batch, GRAD_ATOL)
    layers = model.config.num_hidden_layers
    # each layer attends once in the forward, and once more in backward where checkpointing re-runs it
    assert len(calls) == layers * (2 if checkpointing else 1)
    assert limits[:layers] == [max(tree_attention.FLEX_RECOMPILES, limit)] * layers
    assert torch._dynamo.config.recompile_limit == limit
