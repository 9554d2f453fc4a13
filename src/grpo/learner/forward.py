"""The training pass: token log-probs (and entropies) of a `TrainBatch`'s completions under a model.

`TrainingPass` holds the choices made once per run from the model and config, each logged when it does not apply:
- prefix sharing: the rows of one prompt run the prompt once (exact; needs the KV cache, which gradient
  checkpointing turns off, and a cache that can select rows);
- the tiled output head (`grpo.algo.logprobs.chunked_logps_and_entropy`): the (B, T, V) logits never exist;
- the memory-saving blocks and, opt-in (`lean_linears`), linears of `grpo.perf`, around the gradient pass only;
- a mixture-of-experts model's router loss (`router_aux_loss_coef`): the gradient pass asks the model for router
  logits and keeps the load-balancing loss it returns (`aux_loss`), computed over whole sequences (so the prompt
  is not shared then);
- `torch_compile`: the policy's decoder stack compiled (`grpo.perf.compilation`), in both kinds of pass;
- the layout (`packing`; None: "auto" on the CPU, "padded" elsewhere, `grpo.learner.tree.default_packing`): padded
  rows, or token trees (`grpo.learner.tree`) for every piece or where a cost model puts them below the padded rows,
  none wider than a window the model may apply over the columns of its input (`windows.window_cap`, named once);
  where each forward is a collective across processes, every process takes the same layout for each piece.
Position ids follow the attention mask, as in generation, so left padding never shifts a token's position.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from transformers import DynamicCache

from grpo.algo.logprobs import chunked_logps_and_entropy, logps_and_entropy
from grpo.algo.loss_terms import router_aux_coef
from grpo.distributed.zero import is_partitioned
from grpo.learner import tree, tree_attention, tree_images, tree_probe
from grpo.learner import windows as model_windows
from grpo.learner.batch import TrainBatch
from grpo.learner.prefix import prefix_sharing_unsupported_reason, select_cache_rows, shared_prompts, take_rows
from grpo.learner.tree_images import ImageInputs
from grpo.models.fp32_head import is_fp32_head
from grpo.models.modeling import accepts_logits_to_keep, cache_argument, unwrap
from grpo.models.vision import SUPPRESSED, computes_own_positions, suppressed_tokens
from grpo.perf import blocks, compilation, linears

logger = logging.getLogger("grpo")


class TrainingPass:
    """How this run scores completions; `logps` for the no-gradient passes (old policy, reference), `train` for the
    pass that is backpropagated."""

    def __init__(self, model: Any, args: Any, autocast: Any, mixed_precision: str, pixels: Any = None) -> None:
        self.temperature = args.temperature
        self.pixels = pixels  # a vision-language model's image inputs (`grpo.models.vision.Pixels`)
        # its pixel inputs, and the tokens generation never samples (image placeholders): the same distribution
        # here, without them
        suppressed = tuple(suppressed_tokens(unwrap(model))) if pixels is not None else ()
        self.images = ImageInputs.of(model, pixels, suppressed) if pixels is not None else None
        self.autocast = autocast
        self.router_aux_coef = router_aux_coef(unwrap(model), args)  # the router loss's weight (0.0: off)
        self.router_aux = self.router_aux_coef != 0.0
        self.aux_loss: torch.Tensor | None = None  # the last gradient pass's router loss (router_aux)
        # the router loss is computed over whole padded sequences; an image prompt runs whole in padded rows (its
        # pixel inputs go with each row), once per tree in a tree
        whole_rows = "the router's load-balancing loss is computed over whole sequences" if self.router_aux else None
        reason = prefix_sharing_unsupported_reason(model) or whole_rows
        if pixels is not None:
            reason = reason or "image prompts run whole (their pixel inputs go with each row)"
        if reason is not None:
            logger.info("Training pass runs each row's prompt itself: %s.", reason)
        self.share_prefix = reason is None
        self.packing = args.packing or tree.default_packing(model)  # packing=None: by where the model trains
        if args.packing is None:
            logger.info("packing=None: the training pass lays out as packing=%r here.", self.packing)
        reason = None
        if self.packing != "padded":  # image rows' own reasons (a model module's source read) only where trees may run
            images = tree_images.unsupported_reason(model, pixels) if pixels is not None else None
            reason = tree.unsupported_reason(model) or whole_rows or images
            score = lambda batch, trees: token_logps(model, batch, 1.0, with_entropy=False, as_trees=trees)[0]  # noqa: E731
            reason = reason or tree_probe.mismatch(model, score)  # a few tokens as trees and padded rows
        if reason is not None and self.packing == "tree":
            warnings.warn(f"packing='tree' is not used: {reason}. The padded layout trains instead.", stacklevel=3)
        elif reason is not None:
            logger.info("packing='auto' lays out padded rows: %s.", reason)
        self.tree = self.packing != "padded" and reason is None
        reason = model_windows.window_cap_reason(model) if self.tree else None
        if reason is not None:  # trees past the window would train other numbers, silently
            narrow = f"lays out trees of at most {model_windows.window_cap(model)} tokens: {reason}"
            if self.packing == "tree":
                warnings.warn(
                    f"packing='tree' {narrow}; a piece with a longer row trains as padded rows.", stacklevel=3
                )
            else:
                logger.info("packing='auto' %s.", narrow)
        self.where_cheaper = self.packing == "auto"  # each piece as trees only where they cost less than padded rows
        # with trees: how many pieces ran as "trees" and as "padded" rows (the last gradient pass's: trained_as)
        self.laid_out: Counter[str] = Counter()
        self.trained_as: Counter[str] = Counter()
        reason = tiled_head_unsupported_reason(model)
        if reason is not None:
            logger.info("Training pass computes the full logits: %s.", reason)
        self.chunked_head = reason is None
        low = torch.bfloat16 if mixed_precision == "bf16" and args.lean_linears else None
        reason = linears.unsupported_reason(model, low) if args.lean_linears else None
        if reason is not None:
            logger.info("lean_linears is not used: %s.", reason)
        self.lean_dtype = low if reason is None else None
        reason = blocks.unsupported_reason(model)
        device = getattr(unwrap(model), "device", torch.device("cpu"))
        self.compiled = compilation.compiled_forward(model, args, device)
        if self.compiled is not None:  # the compiler plans the blocks' memory itself: no swapped forwards
            reason = "torch_compile compiles the blocks as transformers writes them"
            if self.lean_dtype is not None:
                warnings.warn("lean_linears is not used with torch_compile (the compiler plans memory).", stacklevel=3)
            self.lean_dtype = None
        if reason is not None:
            logger.info("Training pass keeps the model's own blocks: %s.", reason)
        self.lean_blocks = reason is None

    def for_copy(self, model: Any) -> TrainingPass:
        """This pass for another copy of the policy (an async producer's snapshot, passed to `logps`): with
        torch_compile, the copy's own compiled stack, so that the copy's passes never swap the policy's forward."""
        other = copy.copy(self)
        if self.compiled is not None:
            other.compiled = compilation.CompiledForward(model, self.compiled.backend, self.compiled.mode)
        return other

    def logps(self, model: Any, batch: TrainBatch, chunk_size: int | None = None) -> torch.Tensor:
        """Token log-probs without gradient, under the run's precision, `chunk_size` rows at a time."""
        with torch.no_grad(), self.autocast(), self._compiled():
            logps, _ = token_logps(
                model,
                batch,
                self.temperature,
                with_entropy=False,
                chunk_size=chunk_size,
                share_prefix=self.share_prefix,
                chunked_head=self.chunked_head,
                images=self._images(),
                as_trees=self.tree,
                where_cheaper=self.where_cheaper,
                laid_out=self.laid_out,
            )
        return logps

    def train(self, model: Any, batch: TrainBatch, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Token log-probs and entropies with gradient (entropies only with `entropy_grad`); with `router_aux`,
        the router's load-balancing loss in `self.aux_loss`; with trees, the pieces' layouts in `self.trained_as`."""
        lean = linears.lean_linears(model, self.lean_dtype) if self.lean_dtype else contextlib.nullcontext()
        kept = blocks.lean_blocks(model) if self.lean_blocks else contextlib.nullcontext()
        aux_losses: list[torch.Tensor] | None = [] if self.router_aux else None
        self.trained_as = Counter()
        with self.autocast(), lean, kept, self._compiled():
            logps, entropies = token_logps(
                model,
                batch,
                self.temperature,
                with_entropy=True,
                entropy_grad=entropy_grad,
                share_prefix=self.share_prefix,
                chunked_head=self.chunked_head,
                aux_losses=aux_losses,
                images=self._images(),
                as_trees=self.tree,
                where_cheaper=self.where_cheaper,
                laid_out=self.trained_as,
            )
        self.laid_out.update(self.trained_as)
        self.aux_loss = torch.stack(aux_losses).mean() if aux_losses else None
        assert entropies is not None  # with_entropy
        return logps, entropies

    def _images(self) -> ImageInputs | None:
        return self.images

    def _compiled(self) -> contextlib.AbstractContextManager:
        """torch_compile: the policy's compiled decoder stack for the pass (a reference model runs as it is)."""
        return self.compiled() if self.compiled is not None else contextlib.nullcontext()


def token_logps(
    model: Any,
    batch: TrainBatch,
    temperature: float,
    with_entropy: bool = True,
    chunk_size: int | None = None,
    entropy_grad: bool = False,
    share_prefix: bool = False,
    chunked_head: bool = False,
    aux_losses: list[torch.Tensor] | None = None,
    images: ImageInputs | None = None,
    as_trees: bool = False,
    where_cheaper: bool = False,
    laid_out: Counter[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the completion tokens under `model` (logits divided by temperature), and their entropies,
    as (B, C) tensors (values on padding positions are meaningless: the mask removes them).

    Rows are sorted by completion length and cut into pieces of `chunk_size` rows (one piece when None); each
    piece is trimmed to its own longest completion, so short completions do not pay for a long one's padding.
    Padding never changes a real token's outputs (causal attention, masked keys), so this is exact. Entropies
    carry a gradient only with `entropy_grad` (the entropy bonus). Padding positions skip the lean MLP blocks
    (`grpo.perf.blocks.real_tokens`, in the gradient pass) and the tiled head: their values are 0. With
    `share_prefix`, rows of one prompt run
    the prompt once (see `_forward_shared`). With `chunked_head`, the output projection runs inside
    `chunked_logps_and_entropy`, a chunk of tokens at a time, and the (B, T, V) logits never exist. A piece keeps
    the batch's `pad_to_multiple_of` (its width is rounded up to it). With `aux_losses` (a list), the model is
    asked for its router logits and each piece's load-balancing loss is appended (whole sequences: the prompt is
    then not shared). With `images` (a vision-language model), each piece gets its rows' pixel inputs and the
    suppressed tokens' logits are SUPPRESSED. With `as_trees` (`packing="tree"`), each piece runs as token trees of
    its prompt groups (`grpo.learner.tree`: no padding inside a tree, each prompt once per tree), unless a row is
    longer than one of the model's windows (a tree is never wider than a window the model may apply over the
    columns of its input: `windows.window_cap`); with `where_cheaper` too, a piece without turns runs as trees only
    where the layout's cost model puts them below the padded rows (`tree.cheaper`); where each forward of the model is a
    collective across processes, all of them decide each piece's layout together (`_as_trees`). `laid_out` counts
    the pieces that ran as "trees" and as "padded" rows."""
    plain: Callable[..., torch.Tensor] = _forward_shared if share_prefix and aux_losses is None else _forward
    cost = tree.pair_cost(model) if as_trees else 0.0
    kernel = tree_attention.attention_kernel(model, batch.prompt_ids.device) if as_trees else "dense"
    collective = as_trees and forward_is_collective(model)
    lengths = batch.completion_attention.sum(-1)
    logps: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    for rows in _pieces(lengths, chunk_size):
        part = batch.select(rows).trim(batch.padded_width(max(int(lengths[rows].max()), 1)))
        trees = marked = None
        if as_trees:
            marked = images.marks(part) if images is not None else None
            shared = plain is _forward_shared
            trees = _as_trees(model, part, cost, kernel, where_cheaper, shared, collective, images, marked)
        forward: Callable[..., torch.Tensor] = plain if trees is None else functools.partial(_forward_tree, trees=trees)
        forked = tree.forked(part) if trees is None and part.turns is not None else None  # one row per turn
        if forked is not None:
            forward = _forked(plain, forked)
        extra = None
        if images is not None and trees is not None:
            extra = images.tree_inputs(model, part, trees, marked)
        elif images is not None:  # the rows' own images, or with turns each forked row's
            extra = images.inputs(part) if forked is None else images.forked_inputs(part, forked[0], marked)
        if laid_out is not None and as_trees:
            laid_out["trees" if trees is not None else "padded"] += 1
        outputs = forward(model, part, chunked_head, aux_losses, extra)
        suppressed = images.suppressed if images is not None else ()
        lp, ent = _piece_logps(model, part, outputs, temperature, with_entropy, entropy_grad, chunked_head, suppressed)
        where = (rows.unsqueeze(1), torch.arange(lp.shape[1], device=rows.device))
        logps = (lp.new_zeros(batch.completion_ids.shape) if logps is None else logps).index_put(where, lp)
        if with_entropy:
            entropies = ent.new_zeros(batch.completion_ids.shape) if entropies is None else entropies
            entropies = entropies.index_put(where, ent)
    assert logps is not None  # one piece at least
    return logps, entropies


def _as_trees(
    model: Any,
    part: TrainBatch,
    cost: float,
    kernel: str,
    where_cheaper: bool,
    shared: bool,
    collective: bool,
    images: ImageInputs | None = None,
    marked: tree_images.Marked | None = None,
) -> tree.Tree | None:
    """The piece as token trees (`tree.layout` at pair cost `cost`, for `kernel`), or None for padded rows: trees
    where every row fits the model's windows (`tree.fits_window`), none wider than a window the model may apply
    over columns (`model_windows.window_cap`), and, with `images`, where its image tokens are `marked`
    (`ImageInputs.marks`); with `where_cheaper` (a piece without turns) where they cost less than the padded rows
    (`shared`: the padded pass shares each prompt). Where each forward of the model
    is a collective (`collective`, `forward_is_collective`), every process takes the same layout, as the padded pass
    runs two forwards where it shares the prompt and a tree one: trees where every process's piece fits, and where
    the processes' trees cost less than their padded rows together."""
    fits = tree.fits_window(model, part) and (images is None or marked is not None)
    marks = marked.marks if marked is not None else None
    runs = marked.run_layers if marked is not None else ()
    cap = model_windows.window_cap(model)  # a window the model may apply over columns: no tree wider
    trees = tree.layout(part, cap, pair_cost=cost, kernel=kernel, marks=marks, run_layers=runs) if fits else None
    if trees is not None and cap is not None and trees.input_ids.shape[1] > cap:
        trees = None  # a row alone wider (a row's turns after a stripped branch): padded rows
    judged = trees is not None and where_cheaper and part.turns is None
    votes = [
        float(trees is None),
        float(judged),
        tree.cost(trees, cost) if judged and trees is not None else 0.0,
        tree.padded_cost(part, shared, cost) if judged else 0.0,
    ]
    if collective:
        summed = torch.tensor(votes, dtype=torch.float64, device=part.prompt_ids.device)
        torch.distributed.all_reduce(summed)
        votes = summed.tolist()
    cannot, judges, tree_cost, padded_cost = votes
    if cannot or (judges and tree_cost >= padded_cost):
        return None
    return trees


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


def _piece_logps(model, part, outputs, temperature, with_entropy, entropy_grad, chunked_head, suppressed=()):
    if chunked_head:
        head = unwrap(model).get_output_embeddings()
        dtype = torch.float32 if is_fp32_head(head) else None  # cast_lm_head_to_fp32: project in float32
        bias = head.bias
        if suppressed:  # the head's bias with SUPPRESSED at those tokens: their logits without a (B, T, V) copy
            bias = head.weight.new_zeros(head.weight.shape[0]) if bias is None else bias.clone()
            bias[list(suppressed)] = SUPPRESSED
        real = part.completion_attention.bool()  # padding's log-probs are never read: not projected (0 there)
        if bool(real.all()):
            real = None
        hidden, ids = (outputs, part.completion_ids) if real is None else (outputs[real], part.completion_ids[real])
        lp, ent = chunked_logps_and_entropy(
            hidden, head.weight, bias, ids, temperature, with_entropy, entropy_grad, dtype=dtype
        )
        if real is not None:
            lp = lp.new_zeros(real.shape).masked_scatter(real, lp)
            ent = ent if ent is None else ent.new_zeros(real.shape).masked_scatter(real, ent)
        return lp, ent
    if suppressed:
        outputs = outputs.index_fill(-1, torch.tensor(suppressed, device=outputs.device), SUPPRESSED)
    return logps_and_entropy(outputs / temperature, part.completion_ids, with_entropy, entropy_grad)


def _pieces(lengths: torch.Tensor, chunk_size: int | None) -> list[torch.Tensor]:
    """Row indices sorted by completion length, cut into chunk_size pieces (one piece when None).

    Sorting makes each piece's rows alike in length, so trimming pads less. Splitting an unchunked batch
    further was measured slower on CPU (one more forward costs more than the padding it saves)."""
    order = torch.argsort(lengths, stable=True)
    return list(order.split(chunk_size)) if chunk_size else [order]


def tiled_head_unsupported_reason(model: Any) -> str | None:
    """Why the tiled output head cannot take over this model's head (None when it can). It needs a plain linear head
    with nothing applied after it (no logit soft-capping or scaling), not its own FSDP unit: the tiled kernel reads
    the head's weight outside the head's forward, and FSDP frees a unit's gathered weight when its forward ends (a
    head sharded with the root unit stays gathered, and is fine); nor partitioned by DeepSpeed ZeRO-3, which
    likewise releases it after the head's forward."""
    model = unwrap(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    if not isinstance(head, torch.nn.Linear):
        return "the output head is not a plain linear layer"
    if any(getattr(config, name, None) for name in ("final_logit_softcapping", "logit_scale", "logits_scaling")):
        return "the model scales or caps its logits after the head"
    if isinstance(head, FSDPModule):
        return "the output head is its own FSDP unit"
    if is_partitioned(head):
        return "the output head is partitioned by DeepSpeed ZeRO-3"
    return None


def _outputs(model: Any, chunked_head: bool, aux_losses: list | None = None, **inputs: Any) -> torch.Tensor:
    """The model's logits (B, T, V), or with `chunked_head` the hidden states its output head would have
    projected (B, T, H): a pre-hook captures them and hands the head an empty slice, so no logits are made.
    With `aux_losses`, the model's router loss is appended to it."""
    if aux_losses is not None:
        inputs["output_router_logits"] = True
    if not chunked_head:
        out = model(**inputs)
        _keep_aux_loss(out, aux_losses)
        return out.logits
    captured = {}

    def skip_head(module, args):
        captured["hidden"] = args[0]
        return (args[0][..., :0, :],) + tuple(args[1:])

    handle = unwrap(model).get_output_embeddings().register_forward_pre_hook(skip_head)
    try:
        out = model(**inputs)
    finally:
        handle.remove()
    _keep_aux_loss(out, aux_losses)
    return captured["hidden"]


def _keep_aux_loss(out: Any, aux_losses: list | None) -> None:
    if aux_losses is not None:
        if getattr(out, "aux_loss", None) is None:
            raise ValueError(
                "The model returned no aux_loss although asked for its router logits (output_router_logits=True); "
                "set router_aux_loss_coef=0 to train without the load-balancing loss."
            )
        aux_losses.append(out.aux_loss)


def _forward(
    model: Any, batch: TrainBatch, chunked_head: bool = False, aux_losses: list | None = None, extra: dict | None = None
) -> torch.Tensor:
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
        out = _outputs(
            model,
            chunked_head,
            aux_losses,
            input_ids=input_ids,
            attention_mask=attention,
            **extra,
            **kwargs,
        )
    return out[:, -(c + 1) : -1, :]  # position t predicts completion token t


def _forward_shared(
    model: Any, batch: TrainBatch, chunked_head: bool = False, aux_losses: None = None, extra: None = None
) -> torch.Tensor:
    """The same outputs as `_forward`, running each distinct prompt once (`prefix.shared_prompts`: rows of equal
    prompt tokens; `aux_losses` is always None here: `token_logps` runs whole sequences when the router loss is
    wanted; `extra` too: image prompts run whole).

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
        last = _outputs(
            model,
            chunked_head,
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
        rest = _outputs(
            model,
            chunked_head,
            input_ids=batch.completion_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            **cache_kwargs,
        )
    return torch.cat([take_rows(last[:, -1:, :], inverse), rest[:, :-1, :]], dim=1)


def _forked(plain: Callable[..., torch.Tensor], forked: tuple) -> Callable[..., torch.Tensor]:
    """`plain` (`_forward` or `_forward_shared`) over a batch with turns laid out as one row per turn (`forked`: its
    `grpo.learner.tree.forked`): the outputs at each completion position of the batch, from its own turn's row."""
    rows, row, column = forked

    def forward(
        model: Any, batch: TrainBatch, chunked_head: bool = False, aux_losses: list | None = None, extra: None = None
    ) -> torch.Tensor:
        out = plain(model, rows, chunked_head, aux_losses, extra)
        return take_rows(out.flatten(0, 1), row * out.shape[1] + column)  # out[row, column], as in _forward_tree

    return forward


def _forward_tree(
    model: Any,
    batch: TrainBatch,
    chunked_head: bool = False,
    aux_losses: None = None,
    extra: dict | None = None,
    *,
    trees: tree.Tree,
) -> torch.Tensor:
    """The same outputs as `_forward`, from the rows laid out as token trees (`trees`, `grpo.learner.tree.layout`
    of `batch`): each prompt once and no padding inside a tree (`aux_losses` is always None: router losses keep
    the padded layout). `extra`: the trees' image inputs (`ImageInputs.tree_inputs`), with their own
    `position_ids` where the model derives positions from the images."""
    extra = {"position_ids": trees.positions, **(extra or {})}
    with blocks.real_tokens(trees.real), tree_attention.compiles(trees):
        out = _outputs(
            model,
            chunked_head,
            input_ids=trees.input_ids,
            attention_mask=tree_attention.attention_mask(model, trees),
            use_cache=False,
            **extra,
        )
    # each row's positions in its tree (a prompt's last position is every row's first): copied with a deterministic
    # backward (grpo.learner.prefix), as out[trees.row, trees.column]
    return take_rows(out.flatten(0, 1), trees.row * out.shape[1] + trees.column)
