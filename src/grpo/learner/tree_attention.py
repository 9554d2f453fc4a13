"""The attention of the tree pass (`grpo.learner.tree`): which kernel attends a tree, and the mask each one takes.

A tree's rows say what attends what in two (R, T) tensors, `Tree.first` and `Tree.last`: the query at column q
attends the key at column k where first[k] <= q <= last[k] (each tree is laid out depth first, so a token's
descendants follow it up to the last of its subtree; `first` is the key's own column, or its run's first where image
tokens attend each other both ways). `attention_kernel` picks how that is attended:
- "dense": the (R, 1, T, T) mask (`Tree.mask`), handed to the model as a prepared 4D mask, which transformers uses
  as it is for its eager and SDPA attention; every pair of a row is computed.
- "flex" (an SDPA model on CUDA, where FlexAttention compiles): a block mask from the same rule (`block_mask`), so
  only the blocks of FLEX_BLOCK queries by FLEX_BLOCK keys where one query attends one key are computed
  (`flex_blocks`). transformers' SDPA attention function is extended once to hand a block mask to its FlexAttention
  function (`_route_block_masks`: every other call is unchanged), which also covers the forward that gradient
  checkpointing re-runs in backward. Trees change width from one micro-batch to the next, so torch.compile
  compiles FlexAttention for a few shapes (`_flex_runs` compiles them first) under a raised recompile limit
  (`compiles`): past torch's default it would run uncompiled, computing every pair.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import TYPE_CHECKING, Any

import torch

from grpo.models.modeling import attention_shapes, unwrap

if TYPE_CHECKING:
    from grpo.learner.tree import Tree

logger = logging.getLogger("grpo")

# FlexAttention's block: queries and keys are attended in blocks of this many (where any pair of a block is)
FLEX_BLOCK = 128


def flex_blocks(first: torch.Tensor, last: torch.Tensor) -> int:
    """The (FLEX_BLOCK queries, FLEX_BLOCK keys) blocks where a query attends a key, for rows of first and last
    attending queries `first`, `last` (`Tree.first`, `Tree.last`): a key at column k is attended by the queries
    first[k]..last[k], a span that holds k, so a block of keys by the query blocks from the one holding its keys'
    earliest start to the one holding their furthest end."""
    width = last.shape[1]
    blocks = -(-width // FLEX_BLOCK)
    spare = blocks * FLEX_BLOCK - width
    ends = torch.nn.functional.pad(last, (0, spare), value=-1)
    starts = torch.nn.functional.pad(first, (0, spare), value=blocks * FLEX_BLOCK)
    furthest = ends.view(last.shape[0], blocks, FLEX_BLOCK).amax(-1) // FLEX_BLOCK
    earliest = starts.view(first.shape[0], blocks, FLEX_BLOCK).amin(-1) // FLEX_BLOCK
    return int((furthest - earliest + 1).sum())


def attention_kernel(model: Any, device: torch.device) -> str:
    """The attention kernel the tree pass uses on `device`: "flex" (FlexAttention, block-sparse: only the blocks
    where a query attends a key are computed) for an SDPA model on CUDA without attention dropout, where a small
    forward and backward of the model's attention shape compiles there (`_flex_runs`); else "dense" (the dense
    mask, to SDPA or eager attention). FlexAttention has no backward on the CPU. FORCE_KERNEL, when set, is taken
    as it is (benchmarks and tests)."""
    if FORCE_KERNEL is not None:
        return FORCE_KERNEL
    config = unwrap(model).config
    if device.type != "cuda" or config._attn_implementation != "sdpa":
        return "dense"
    if getattr(config, "attention_dropout", 0.0) and unwrap(model).training:
        return "dense"  # FlexAttention has no dropout
    shapes = attention_shapes(text_config(model))
    if shapes is None:
        return "dense"  # no attention shape to probe
    dtype = (
        torch.get_autocast_dtype("cuda")
        if torch.is_autocast_enabled("cuda")
        else next(unwrap(model).parameters()).dtype
    )
    return "flex" if all(_flex_runs(device, dtype, shape) for shape in dict.fromkeys(shapes)) else "dense"


def text_config(model: Any) -> Any:
    """The model's config, its language model's for a vision-language model."""
    config = unwrap(model).config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# set to "flex" or "dense" to lay out every tree for that kernel (None: `attention_kernel` chooses)
FORCE_KERNEL: str | None = None


@contextlib.contextmanager
def dense_kernel():
    """Every tree laid out for the dense mask inside (`grpo.learner.tree_probe`: no FlexAttention compiled for its
    few tokens)."""
    global FORCE_KERNEL
    kept, FORCE_KERNEL = FORCE_KERNEL, "dense"
    try:
        yield
    finally:
        FORCE_KERNEL = kept


_FLEX_RUNS: dict[tuple, bool] = {}


def _flex_runs(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int]) -> bool:
    """Whether FlexAttention's compiled forward and backward run on `device` for `dtype` and (query heads, key
    heads, head dim) `shape` (once per such triple: the kernels can lack resources on some GPUs, e.g. shared
    memory for large heads); where not, one warning names why and the dense mask is used. Three shapes are run: one
    row of two blocks, then two rows and one row of a width no block divides, as trees have. torch.compile
    recompiles FlexAttention for the second (its automatic dynamic shapes: rows and width no longer fixed) and the
    third (one row is always a shape of its own); every later micro-batch runs one of those, so a kernel that fails
    only when recompiled fails here, not in the middle of a run."""
    key = (str(device), dtype, shape)
    if key not in _FLEX_RUNS:
        try:
            _route_block_masks()
            with _recompiles():
                for rows, width in ((1, 2 * FLEX_BLOCK), (2, 3 * FLEX_BLOCK - 5), (1, 3 * FLEX_BLOCK - 5)):
                    _probe(device, dtype, shape, rows, width)
            _FLEX_RUNS[key] = True
            logger.info("The tree pass attends with FlexAttention on %s (%s).", device, dtype)
        except Exception as error:  # noqa: BLE001 - any failure to compile or run means: use the dense mask
            warnings.warn(
                f"FlexAttention does not run here ({type(error).__name__}: {error}); the tree pass attends with "
                "a dense mask instead (the same numbers, more work per row).",
                stacklevel=2,
            )
            _FLEX_RUNS[key] = False
    return _FLEX_RUNS[key]


def _probe(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int], rows: int, width: int) -> None:
    """FlexAttention's forward and backward over `rows` causal rows of `width` queries of `shape` (`_flex_runs`)."""
    heads, kv_heads, dim = shape
    probe = torch.nn.Module()
    probe.train()
    with torch.inference_mode(False), torch.enable_grad():  # asked first from a pass without gradients too
        # ones, not random draws: the run's random streams stay as they are
        query = torch.ones(rows, heads, width, dim, device=device, dtype=dtype, requires_grad=True)
        key_value = torch.ones(rows, kv_heads, width, dim, device=device, dtype=dtype, requires_grad=True)
        last = torch.full((rows, width), width - 1, device=device)
        first = torch.arange(width, device=device).expand(rows, width)
        out, _ = _flex_attention(probe, query, key_value, key_value, block_mask(first, last), scaling=dim**-0.5)
        out.float().sum().backward()


def block_mask(first: torch.Tensor, last: torch.Tensor) -> Any:
    """FlexAttention's block mask of rows of first and last attending queries `first`, `last` (`Tree.first`,
    `Tree.last`): a query at column q attends the key at column k where first[k] <= q <= last[k]."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, width = last.shape
    # both ends in one tensor, read once per key: Inductor's CPU template (torch 2.13) fails to compile a mask that
    # reads two tensors at the key's column ("cur_kvSplitSize8 was not declared")
    span = first * width + last

    def ancestor(b, h, q, k):  # noqa: ANN001 - FlexAttention's mask_mod signature
        ends = span[b, k]
        return (ends // width <= q) & (q <= ends % width)

    return create_block_mask(ancestor, rows, None, width, width, device=last.device, BLOCK_SIZE=FLEX_BLOCK)


def _route_block_masks() -> None:
    """Routes a block mask given to transformers' SDPA attention to its FlexAttention function instead (once per
    process): models attend through the attention function their config names at each call, "sdpa" here, also in
    the forward that gradient checkpointing re-runs during backward; SDPA cannot take a block mask, so every other
    call runs as before."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if getattr(sdpa, "routes_block_masks", False):
        return

    def sdpa_or_flex(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN202
        if isinstance(attention_mask, BlockMask):
            return _flex_attention(module, query, key, value, attention_mask, **kwargs)
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    sdpa_or_flex.routes_block_masks = True  # type: ignore[attr-defined]
    AttentionInterface.register("sdpa", sdpa_or_flex)


def _flex_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """transformers' FlexAttention function, which block masks are routed to (`_route_block_masks`; looked up at
    each call, so the tests can stand a dense twin in for it on the CPU, where FlexAttention has no backward)."""
    from transformers.integrations.flex_attention import flex_attention_forward

    return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)


# how many times torch.compile may compile FlexAttention's function over while the tree pass runs (torch's default:
# 8 per function, after which it runs uncompiled, a kernel that computes every pair): each head shape (Gemma 4 has
# two), with and without gradients, compiles for one row and for several (`_flex_runs`)
FLEX_RECOMPILES = 64


def compiles(tree: Tree) -> Any:
    """The context the tree pass runs in: for the "flex" kernel, `_recompiles`."""
    return _recompiles() if tree.kernel == "flex" else contextlib.nullcontext()


def _recompiles() -> Any:
    """torch.compile's recompile limit raised to at least FLEX_RECOMPILES, for a while."""
    import torch._dynamo

    return torch._dynamo.config.patch(recompile_limit=max(FLEX_RECOMPILES, torch._dynamo.config.recompile_limit))


def attention_mask(model: Any, tree: Tree) -> Any:
    """The tree's mask as the model's attention takes a prepared one: a FlexAttention block mask for the "flex"
    kernel, boolean for SDPA, additive for eager. Where runs of image tokens attend each other both ways in some of
    the model's layers only (`Tree.run_layers`), one mask per layer type (transformers' mask mapping: those layers
    the tree's, the others `Tree.without_runs`'s)."""
    layer_types = set(getattr(text_config(model), "layer_types", None) or ())
    if tree.run_layers is not None and not layer_types <= set(tree.run_layers):
        plain = tree.without_runs()
        return {kind: _prepared(model, tree if kind in tree.run_layers else plain) for kind in sorted(layer_types)}
    return _prepared(model, tree)


def _prepared(model: Any, tree: Tree) -> Any:
    """`attention_mask` for every layer alike."""
    if tree.kernel == "flex":
        _route_block_masks()
        return block_mask(tree.first, tree.last)
    mask = tree.mask  # built from `Tree.first` and `Tree.last` at each read: once here
    if unwrap(model).config._attn_implementation == "sdpa":
        return mask
    dtype = next(unwrap(model).parameters()).dtype
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
