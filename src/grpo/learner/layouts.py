"""The training pass's layouts: how a piece of a micro-batch is laid out for the model, one entry per layout in
`LAYOUTS`, as `grpo.algo.losses.LOSS_TYPES` holds one entry per loss type.

- "padded": each completion a row, right-padded to the piece's longest, after its left-padded prompt;
- "shared_prefix": those rows, each distinct prompt run once and its KV cache copied to its rows (exact: a prompt
  token never sees a completion, so its keys and values are the same for every row; `grpo.learner.prefix`);
- "forked": a piece whose rows have turns (`TrainBatch.turns`) as one row per turn, the turn's context as its
  prompt (`tree.forked`), run as padded or shared-prefix rows;
- "trees": token trees of each prompt group (`grpo.learner.tree`): each prompt once per tree, no padding inside a
  tree, attention by an ancestor mask (`grpo.learner.tree_attention`), image tokens marked with their images
  (`grpo.learner.tree_images`).

Each is a `Layout`: why a run cannot take it (`unsupported_reason`, asked once per run by `settle`, which logs it),
what the cost model prices a piece at in its layout (`cost`: each computed position 1, each (query, key) pair of
attention `tree.pair_cost`; None for forked rows, which are never weighed), and its forward (the outputs predicting
each completion token, and the router's load-balancing loss where asked). `pick` chooses each piece's layout:
- trees where the pass may lay them out (`packing="tree"` or `"auto"`, the model allows them, no router loss),
  every row fits the model's windows and no tree is wider than a window it may apply over columns; with `by_cost`
  (`"auto"`), a piece without turns only where the trees cost less than its rows;
- else its rows: shared-prefix rows where the model shares a prompt's pass (not with the router's loss, computed
  over whole sequences, nor with image prompts, whose pixel inputs go with each row), else padded rows; forked into
  one row per turn where the piece has turns.
Where each forward of the model is a collective across processes, every process takes the same layout for each
piece (`_takes_trees`): the padded pass runs two forwards where it shares the prompt and a tree one.
Position ids follow the attention mask, as in generation, so left padding never shifts a token's position.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from transformers import DynamicCache

from grpo.distributed.zero import is_partitioned
from grpo.learner import tree, tree_attention, tree_images, tree_probe
from grpo.learner import windows as model_windows
from grpo.learner.batch import TrainBatch
from grpo.learner.prefix import prefix_sharing_unsupported_reason, select_cache_rows, shared_prompts, take_rows
from grpo.learner.tree_images import ImageInputs, Marked
from grpo.models.modeling import accepts_logits_to_keep, cache_argument, unwrap
from grpo.models.vision import computes_own_positions
from grpo.perf import blocks

logger = logging.getLogger("grpo")

# (outputs predicting each completion token (B, C, V or H), the router's load-balancing loss or None)
Outputs = tuple[torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class PassSettings:
    """What a pass over a batch reads besides the model and the batch (`grpo.learner.forward.token_logps`).

    `temperature` divides the logits; `with_entropy` scores entropies too, with a gradient only with `entropy_grad`
    (the entropy bonus); `chunk_size` rows at most per piece (None: one piece); `chunked_head`: the tiled output head
    (`grpo.algo.logprobs.chunked_logps_and_entropy`), so the (B, T, V) logits never exist; `router_aux`: the model is
    asked for its router logits and returns its load-balancing loss (whole sequences); `images`: a vision-language
    model's image inputs. `layouts`: the layouts the pieces may take (names in `LAYOUTS`; padded rows, and forked
    rows for a piece with turns, are taken where no other is, named or not); with `by_cost` (`packing="auto"`) a
    piece without turns takes trees only where they cost less than its rows."""

    temperature: float = 1.0
    with_entropy: bool = True
    entropy_grad: bool = False
    chunk_size: int | None = None
    chunked_head: bool = False
    router_aux: bool = False
    images: ImageInputs | None = None
    layouts: tuple[str, ...] = ("padded", "forked")
    by_cost: bool = False

    def __post_init__(self) -> None:
        unknown = [name for name in self.layouts if name not in LAYOUTS]
        if unknown:
            raise ValueError(f"Unknown layouts {unknown}: the training pass lays out {list(LAYOUTS)}.")


@dataclass(frozen=True)
class Piece:
    """A piece of the batch (`part`) as its `layout` lays it out, with what the layout's forward reads: the pass's
    `settings`; the piece's `trees` (trees); its forked rows, and for each completion position of `part` the forked
    row and column that hold it (forked: `tree.forked`), run as `rows` ("padded" or "shared_prefix"); its image
    tokens marked (`marked`, `ImageInputs.marks`, where the pass may lay out trees of image rows)."""

    layout: str
    part: TrainBatch
    settings: PassSettings
    trees: tree.Tree | None = None
    forked: tuple[TrainBatch, torch.Tensor, torch.Tensor] | None = None
    rows: str = "padded"
    marked: Marked | None = None


@dataclass(frozen=True)
class RunFacts:
    """What a layout's `unsupported_reason` reads of a run besides its model: whether the router's load-balancing
    loss is on, the image inputs (`grpo.models.vision.Pixels`, None without images), and how the pass scores a
    batch's completion log-probs as trees or as padded rows (`score(batch, as_trees)`: the tree probe runs it both
    ways, `tree_probe.mismatch`; None: no probe)."""

    router_aux: bool = False
    pixels: Any = None
    score: Callable[[TrainBatch, bool], torch.Tensor] | None = None


@dataclass(frozen=True)
class Layout:
    """One layout: why a run cannot take it (None where it can), the cost model's price of a piece laid out so at a
    pair cost (None: never weighed), and its forward."""

    unsupported_reason: Callable[[Any, RunFacts], str | None]
    cost: Callable[[Piece, float], float] | None
    forward: Callable[[Any, Piece], Outputs]


# ---- the forwards ----------------------------------------------------------------------------------------------------


def _outputs(model: Any, chunked_head: bool, router_aux: bool, **inputs: Any) -> Outputs:
    """The model's logits (B, T, V), or with `chunked_head` the hidden states its output head would have
    projected (B, T, H): a pre-hook captures them and hands the head an empty slice, so no logits are made. With
    `router_aux`, the model's router loss too."""
    if router_aux:
        inputs["output_router_logits"] = True
    if not chunked_head:
        out = model(**inputs)
        return out.logits, _aux_loss(out, router_aux)
    captured = {}

    def skip_head(module, args):
        captured["hidden"] = args[0]
        return (args[0][..., :0, :],) + tuple(args[1:])

    handle = unwrap(model).get_output_embeddings().register_forward_pre_hook(skip_head)
    try:
        out = model(**inputs)
    finally:
        handle.remove()
    return captured["hidden"], _aux_loss(out, router_aux)


def _aux_loss(out: Any, router_aux: bool) -> torch.Tensor | None:
    if not router_aux:
        return None
    if getattr(out, "aux_loss", None) is None:
        raise ValueError(
            "The model returned no aux_loss although asked for its router logits (output_router_logits=True); "
            "set router_aux_loss_coef=0 to train without the load-balancing loss."
        )
    return out.aux_loss


def _rows(model: Any, batch: TrainBatch, settings: PassSettings, extra: dict | None) -> Outputs:
    """Outputs predicting each completion token, (B, C, V or H), from one pass over prompt + completion. `extra`:
    a vision-language model's pixel inputs (`ImageInputs.inputs`); position ids are given unless the model
    derives its own from the image layout."""
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attention = torch.cat([batch.prompt_mask, batch.completion_attention], dim=1)
    if extra is None or not computes_own_positions(unwrap(model)):
        extra = {**(extra or {}), "position_ids": (attention.cumsum(-1) - 1).clamp(min=0)}
    c = batch.completion_ids.shape[1]
    kwargs = {"logits_to_keep": c + 1} if accepts_logits_to_keep(unwrap(model)) else {}
    with blocks.real_tokens(attention):
        out, aux = _outputs(
            model,
            settings.chunked_head,
            settings.router_aux,
            input_ids=input_ids,
            attention_mask=attention,
            **extra,
            **kwargs,
        )
    return out[:, -(c + 1) : -1, :], aux  # position t predicts completion token t


def _shared_rows(model: Any, batch: TrainBatch, settings: PassSettings) -> Outputs:
    """The same outputs as `_rows`, running each distinct prompt once (`prefix.shared_prompts`: rows of equal
    prompt tokens; never with the router loss, computed over whole sequences, nor with image prompts: `pick`).

    The prompt pass fills a KV cache (with gradient), whose rows are copied to the completions of that prompt;
    the completions then attend to it. Causal attention makes this exact: a prompt token never sees the
    completion, so its keys and values are the same for all G rows, and autograd sums their gradients back.
    With prompts longer than completions this removes most of the training pass's work."""
    # one row per distinct prompt (which one does not matter: they hold the same tokens), by its tokens: a group's
    # samples may come with different prompts (a rollout_func's prompt_ids)
    first, inverse = shared_prompts(batch)
    prompt_mask = batch.prompt_mask[first]
    cache = DynamicCache()
    cache_arg = cache_argument(unwrap(model))
    cache_kwargs: dict[str, Any] = {cache_arg: cache}  # the model's name for the cache argument
    prompt_positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    with blocks.real_tokens(prompt_mask):
        last, _ = _outputs(
            model,
            settings.chunked_head,
            False,
            input_ids=batch.prompt_ids[first],
            attention_mask=prompt_mask,
            position_ids=prompt_positions,
            use_cache=True,
            logits_to_keep=1,
            **cache_kwargs,
        )
    select_cache_rows(cache, inverse)  # deterministic backward (grpo.learner.prefix)
    attention = torch.cat([batch.prompt_mask, batch.completion_attention], dim=1)
    c = batch.completion_ids.shape[1]
    positions = batch.prompt_mask.sum(-1, keepdim=True) + torch.arange(c, device=attention.device)
    with blocks.real_tokens(batch.completion_attention):
        rest, _ = _outputs(
            model,
            settings.chunked_head,
            False,
            input_ids=batch.completion_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            **cache_kwargs,
        )
    return torch.cat([take_rows(last[:, -1:, :], inverse), rest[:, :-1, :]], dim=1), None


def _padded(model: Any, piece: Piece) -> Outputs:
    """Padded rows, each with its own pixel inputs (`ImageInputs.inputs`)."""
    images = piece.settings.images
    return _rows(model, piece.part, piece.settings, images.inputs(piece.part) if images is not None else None)


def _shared(model: Any, piece: Piece) -> Outputs:
    """Padded rows, each distinct prompt run once (`_shared_rows`)."""
    return _shared_rows(model, piece.part, piece.settings)


def _forked(model: Any, piece: Piece) -> Outputs:
    """One row per turn (`piece.forked`), as padded or shared-prefix rows (`piece.rows`), each forked row with the
    images its tokens hold (`ImageInputs.forked_inputs`): the outputs at each completion position of the piece,
    from its own turn's row."""
    assert piece.forked is not None
    rows, row, column = piece.forked
    images = piece.settings.images
    if piece.rows == "shared_prefix":
        out, aux = _shared_rows(model, rows, piece.settings)
    else:
        extra = images.forked_inputs(piece.part, rows, piece.marked) if images is not None else None
        out, aux = _rows(model, rows, piece.settings, extra)
    return take_rows(out.flatten(0, 1), row * out.shape[1] + column), aux  # out[row, column], as in _trees


def _trees(model: Any, piece: Piece) -> Outputs:
    """The same outputs as `_rows`, from the rows laid out as token trees (`piece.trees`, `tree.layout` of the
    piece): each prompt once and no padding inside a tree (never with the router loss: `pick`). The trees' image
    inputs (`ImageInputs.tree_inputs`) come with their own `position_ids` where the model derives positions from
    the images."""
    trees, settings = piece.trees, piece.settings
    assert trees is not None
    extra = {"position_ids": trees.positions}
    if settings.images is not None:
        extra.update(settings.images.tree_inputs(model, piece.part, trees, piece.marked))
    with blocks.real_tokens(trees.real), tree_attention.compiles(trees):
        out, _ = _outputs(
            model,
            settings.chunked_head,
            False,
            input_ids=trees.input_ids,
            attention_mask=tree_attention.attention_mask(model, trees),
            use_cache=False,
            **extra,
        )
    # each row's positions in its tree (a prompt's last position is every row's first): copied with a deterministic
    # backward (grpo.learner.prefix), as out[trees.row, trees.column]
    return take_rows(out.flatten(0, 1), trees.row * out.shape[1] + trees.column), None


# ---- why a run cannot take a layout, and its cost --------------------------------------------------------------------

WHOLE_ROWS = "the router's load-balancing loss is computed over whole sequences"


def _always(model: Any, run: RunFacts) -> str | None:
    return None


def _shared_prefix_unsupported_reason(model: Any, run: RunFacts) -> str | None:
    reason = prefix_sharing_unsupported_reason(model) or (WHOLE_ROWS if run.router_aux else None)
    if run.pixels is not None:
        reason = reason or "image prompts run whole (their pixel inputs go with each row)"
    return reason


def _trees_unsupported_reason(model: Any, run: RunFacts) -> str | None:
    """Why trees would not give the padded rows' numbers: the model's (`tree.unsupported_reason`), the router loss's,
    image rows' (a model module's source read: `tree_images.unsupported_reason`), then a few tokens run both ways
    (`tree_probe.mismatch`)."""
    images = tree_images.unsupported_reason(model, run.pixels) if run.pixels is not None else None
    reason = tree.unsupported_reason(model) or (WHOLE_ROWS if run.router_aux else None) or images
    if reason is None and run.score is not None:
        reason = tree_probe.mismatch(model, run.score)
    return reason


def _padded_cost(piece: Piece, pair_cost: float) -> float:
    return tree.padded_cost(piece.part, False, pair_cost)


def _shared_cost(piece: Piece, pair_cost: float) -> float:
    return tree.padded_cost(piece.part, True, pair_cost)


def _trees_cost(piece: Piece, pair_cost: float) -> float:
    assert piece.trees is not None
    return tree.cost(piece.trees, pair_cost)


LAYOUTS: dict[str, Layout] = {
    "padded": Layout(_always, _padded_cost, _padded),
    "shared_prefix": Layout(_shared_prefix_unsupported_reason, _shared_cost, _shared),
    "forked": Layout(_always, None, _forked),
    "trees": Layout(_trees_unsupported_reason, _trees_cost, _trees),
}


# ---- the run's layouts, and each piece's -----------------------------------------------------------------------------


def settle(model: Any, packing: str, run: RunFacts) -> tuple[str, ...]:
    """The layouts this run's pieces may take under `packing` ("padded", "tree" or "auto"): each of `LAYOUTS` its
    `unsupported_reason` does not refuse, trees only where `packing` asks for them. A refused layout is logged with
    its reason (packing="tree" warns where trees are refused), and so is a window that keeps trees narrow."""
    usable = []
    for name, layout in LAYOUTS.items():
        if name == "trees" and packing == "padded":
            continue
        reason = layout.unsupported_reason(model, run)
        if reason is None:
            usable.append(name)
        elif name == "shared_prefix":
            logger.info("Training pass runs each row's prompt itself: %s.", reason)
        elif packing == "tree":
            warnings.warn(f"packing='tree' is not used: {reason}. The padded layout trains instead.", stacklevel=4)
        else:
            logger.info("packing='auto' lays out padded rows: %s.", reason)
    reason = model_windows.window_cap_reason(model) if "trees" in usable else None
    if reason is not None:  # trees past the window would train other numbers, silently
        narrow = f"lays out trees of at most {model_windows.window_cap(model)} tokens: {reason}"
        if packing == "tree":
            warnings.warn(f"packing='tree' {narrow}; a piece with a longer row trains as padded rows.", stacklevel=4)
        else:
            logger.info("packing='auto' %s.", narrow)
    return tuple(usable)


@dataclass(frozen=True)
class TreeSetup:
    """How a pass lays out its pieces' trees: the cost model's price of a (query, key) pair (`tree.pair_cost`), the
    attention kernel (`tree_attention.attention_kernel`: "dense" or "flex"), the widest tree the model's windows
    allow (`windows.window_cap`, None: `tree.MAX_WIDTH`), and whether every process must take the same layout for
    each piece (`forward_is_collective`)."""

    pair_cost: float
    kernel: str
    cap: int | None
    collective: bool

    @classmethod
    def of(cls, model: Any, device: torch.device) -> TreeSetup:
        cost = tree.pair_cost(model)
        kernel = tree_attention.attention_kernel(model, device)
        return cls(cost, kernel, model_windows.window_cap(model), forward_is_collective(model))


def pick(model: Any, part: TrainBatch, settings: PassSettings, setup: TreeSetup | None) -> Piece:
    """The piece `part` laid out (see the module's docstring): as trees where `setup` is given (the pass may lay out
    trees), they can hold the piece (`_lay_trees`) and, with `by_cost` for a piece without turns, cost less than
    its rows (`_takes_trees`); else as its rows, forked into one row per turn where it has turns."""
    s = settings
    rows = "shared_prefix" if "shared_prefix" in s.layouts and not s.router_aux and s.images is None else "padded"
    marked = s.images.marks(part) if setup is not None and s.images is not None else None
    if setup is not None:
        laid = _lay_trees(model, part, s.images, marked, setup)
        trees = Piece("trees", part, s, trees=laid, marked=marked) if laid is not None else None
        if _takes_trees(trees, Piece(rows, part, s), s.by_cost and part.turns is None, setup):
            assert trees is not None
            return trees
    if part.turns is not None:
        return Piece("forked", part, s, forked=tree.forked(part), rows=rows, marked=marked)
    return Piece(rows, part, s)


def _lay_trees(
    model: Any, part: TrainBatch, images: ImageInputs | None, marked: Marked | None, setup: TreeSetup
) -> tree.Tree | None:
    """The piece as token trees (`tree.layout` at `setup`'s pair cost, for its kernel), or None where trees cannot
    hold it: a row longer than one of the model's windows (`tree.fits_window`), image rows whose tokens are not
    `marked` (`ImageInputs.marks`), or a tree wider than a window the model may apply over columns (`setup.cap`: a
    row alone, its turns after a stripped branch)."""
    if not tree.fits_window(model, part) or (images is not None and marked is None):
        return None
    marks = marked.marks if marked is not None else None
    runs = marked.run_layers if marked is not None else ()
    trees = tree.layout(part, setup.cap, pair_cost=setup.pair_cost, kernel=setup.kernel, marks=marks, run_layers=runs)
    if setup.cap is not None and trees.input_ids.shape[1] > setup.cap:
        return None
    return trees


def _takes_trees(trees: Piece | None, rows: Piece, judged: bool, setup: TreeSetup) -> bool:
    """Whether the piece runs as `trees` (None: they cannot hold it) rather than as `rows`: wherever they can, or
    where `judged` only where they cost less (`Layout.cost` at `setup.pair_cost`). Where each forward of the model is
    a collective (`setup.collective`), every process takes the same layout, as the padded pass runs two forwards
    where it shares the prompt and a tree one: trees where every process's piece can take them, and where the
    processes' trees cost less than their rows together."""
    judged = judged and trees is not None
    votes = [
        float(trees is None),
        float(judged),
        _price(trees, setup.pair_cost) if judged and trees is not None else 0.0,
        _price(rows, setup.pair_cost) if judged else 0.0,
    ]
    if setup.collective:
        summed = torch.tensor(votes, dtype=torch.float64, device=rows.part.prompt_ids.device)
        torch.distributed.all_reduce(summed)
        votes = summed.tolist()
    cannot, judges, tree_cost, rows_cost = votes
    return not (cannot or (judges and tree_cost >= rows_cost))


def _price(piece: Piece, pair_cost: float) -> float:
    cost = LAYOUTS[piece.layout].cost
    assert cost is not None, f"{piece.layout} pieces are never weighed"
    return cost(piece, pair_cost)


def forward_is_collective(model: Any) -> bool:
    """Whether each forward of `model` is a collective across the run's processes (DDP's broadcast of buffers, the
    parameter gathers of FSDP and ZeRO-3), so that every process must run as many forwards as the others. A model
    that is none of these (an async producer's snapshot) runs on its own."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False
    if torch.distributed.get_world_size() < 2:
        return False
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) or is_partitioned(model):
        return True
    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())
