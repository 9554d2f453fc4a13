"""The training pass: token log-probs (and entropies) of a `TrainBatch`'s completions under a model.

`token_logps` scores a batch in pieces, each laid out as `grpo.learner.layouts.pick` chooses (padded rows, shared
prefixes, forked turns or token trees: `layouts.LAYOUTS`), and returns one `PassOutput`: the log-probs, the
entropies, the router's load-balancing loss and the layout of each piece.

`TrainingPass` holds the choices made once per run from the model and config, each logged when it does not apply:
- the layouts the run's pieces may take (`packing`; None: "auto" on the CPU, "padded" elsewhere,
  `grpo.learner.tree.default_packing`), each with its reason where the model cannot take it (`layouts.settle`):
  prefix sharing needs the KV cache, which gradient checkpointing turns off; trees, where they apply, for every
  piece or where a cost model puts them below the padded rows;
- the tiled output head (`grpo.algo.logprobs.chunked_logps_and_entropy`): the (B, T, V) logits never exist;
- the memory-saving blocks and, opt-in (`lean_linears`), linears of `grpo.perf`, around the gradient pass only;
- a mixture-of-experts model's router loss (`router_aux_loss_coef`): the gradient pass asks the model for router
  logits and returns the load-balancing loss it computes (`PassOutput.aux_loss`), over whole sequences (so the
  prompt is not shared then, and pieces keep their rows);
- `torch_compile`: the policy's decoder stack compiled (`grpo.perf.compilation`), in both kinds of pass.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from grpo.algo.logprobs import chunked_logps_and_entropy, logps_and_entropy
from grpo.algo.loss_terms import router_aux_coef
from grpo.config import ResolvedConfig
from grpo.distributed.zero import is_partitioned
from grpo.learner import layouts, tree
from grpo.learner.batch import TrainBatch
from grpo.learner.layouts import LAYOUTS, PassSettings, RunFacts, TreeSetup, pick
from grpo.learner.tree_images import ImageInputs
from grpo.models.fp32_head import is_fp32_head
from grpo.models.modeling import unwrap
from grpo.models.vision import SUPPRESSED, suppressed_tokens
from grpo.perf import blocks, compilation, linears

logger = logging.getLogger("grpo")


@dataclass(frozen=True)
class PassOutput:
    """What a pass over a batch returns: the completion tokens' log-probs and entropies, (B, C) (values on padding
    positions are meaningless: the mask removes them; entropies None unless asked for), the router's
    load-balancing loss (the mean over the pieces; None unless asked for), and each piece's layout (`LAYOUTS`'
    names, in the order the pieces ran)."""

    logps: torch.Tensor
    entropies: torch.Tensor | None
    aux_loss: torch.Tensor | None
    layouts: tuple[str, ...]


class TrainingPass:
    """How this run scores completions; `logps` for the no-gradient passes (old policy, reference), `train` for the
    pass that is backpropagated. `laid_out` counts the pieces of every pass so far by layout (for inspection: the
    trainer reads each gradient pass's `PassOutput.layouts`)."""

    def __init__(
        self, model: Any, args: ResolvedConfig, autocast: Any, mixed_precision: str, pixels: Any = None
    ) -> None:
        self.temperature = args.temperature
        # a vision-language model's image inputs (`grpo.models.vision.Pixels`), with the tokens generation never
        # samples (image placeholders): the same distribution here, without them
        suppressed = tuple(suppressed_tokens(unwrap(model))) if pixels is not None else ()
        self.images = ImageInputs.of(model, pixels, suppressed) if pixels is not None else None
        self.autocast = autocast
        self.router_aux_coef = router_aux_coef(unwrap(model), args)  # the router loss's weight (0.0: off)
        self.router_aux = self.router_aux_coef != 0.0
        self.packing = args.packing or tree.default_packing(model)  # packing=None: by where the model trains
        if args.packing is None:
            logger.info("packing=None: the training pass lays out as packing=%r here.", self.packing)
        probe = functools.partial(_probe_score, model)  # a few tokens as trees and padded rows
        self.layouts = layouts.settle(model, self.packing, RunFacts(self.router_aux, pixels, probe))
        self.by_cost = self.packing == "auto"  # each piece as trees only where they cost less than padded rows
        self.laid_out: Counter[str] = Counter()
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

    @property
    def tree(self) -> bool:
        """Whether pieces may run as token trees (packing "tree" or "auto", where the model takes them)."""
        return "trees" in self.layouts

    @property
    def share_prefix(self) -> bool:
        """Whether the rows of one prompt may share its pass (`layouts`' "shared_prefix")."""
        return "shared_prefix" in self.layouts

    def for_copy(self, model: Any) -> TrainingPass:
        """This pass for another copy of the policy (an async producer's snapshot, passed to `logps`): with
        torch_compile, the copy's own compiled stack, so that the copy's passes never swap the policy's forward."""
        other = copy.copy(self)
        if self.compiled is not None:
            other.compiled = compilation.CompiledForward(model, self.compiled.backend, self.compiled.mode)
        return other

    def settings(self, **kwargs: Any) -> PassSettings:
        """This run's `PassSettings`, with `kwargs` (`with_entropy`, `chunk_size`, ...) on top."""
        return PassSettings(
            temperature=self.temperature,
            chunked_head=self.chunked_head,
            images=self.images,
            layouts=self.layouts,
            by_cost=self.by_cost,
            **kwargs,
        )

    def logps(self, model: Any, batch: TrainBatch, chunk_size: int | None = None) -> torch.Tensor:
        """Token log-probs without gradient, under the run's precision, `chunk_size` rows at a time."""
        with torch.no_grad(), self.autocast(), self._compiled():
            out = token_logps(model, batch, self.settings(with_entropy=False, chunk_size=chunk_size))
        self.laid_out.update(out.layouts)
        return out.logps

    def train(self, model: Any, batch: TrainBatch, entropy_grad: bool) -> PassOutput:
        """Token log-probs and entropies with gradient (entropies only with `entropy_grad`); with `router_aux`,
        the router's load-balancing loss."""
        lean = linears.lean_linears(model, self.lean_dtype) if self.lean_dtype else contextlib.nullcontext()
        kept = blocks.lean_blocks(model) if self.lean_blocks else contextlib.nullcontext()
        settings = self.settings(entropy_grad=entropy_grad, router_aux=self.router_aux)
        with self.autocast(), lean, kept, self._compiled():
            out = token_logps(model, batch, settings)
        self.laid_out.update(out.layouts)
        return out

    def _compiled(self) -> contextlib.AbstractContextManager:
        """torch_compile: the policy's compiled decoder stack for the pass (a reference model runs as it is)."""
        return self.compiled() if self.compiled is not None else contextlib.nullcontext()


def _probe_score(model: Any, batch: TrainBatch, as_trees: bool) -> torch.Tensor:
    """The tree probe's pass (`grpo.learner.tree_probe`): completion log-probs at temperature 1, as trees or
    padded rows."""
    settings = PassSettings(with_entropy=False, layouts=("padded", "trees") if as_trees else ("padded",))
    return token_logps(model, batch, settings).logps


def token_logps(model: Any, batch: TrainBatch, settings: PassSettings = PassSettings()) -> PassOutput:
    """Log-probs of the completion tokens under `model` (logits divided by `settings.temperature`), and their
    entropies (`with_entropy`), as (B, C) tensors (values on padding positions are meaningless: the mask removes them).

    Rows are sorted by completion length and cut into pieces of `chunk_size` rows (one piece when None); each
    piece is trimmed to its own longest completion, so short completions do not pay for a long one's padding.
    Padding never changes a real token's outputs (causal attention, masked keys), so this is exact. Entropies
    carry a gradient only with `entropy_grad` (the entropy bonus). Each piece is laid out as `layouts.pick`
    chooses among `settings.layouts` and runs its layout's forward (`LAYOUTS`). Padding positions skip the lean MLP
    blocks (`grpo.perf.blocks.real_tokens`, in the gradient pass) and the tiled head (`chunked_head`: the output
    projection runs inside `chunked_logps_and_entropy`, a chunk of tokens at a time, and the (B, T, V) logits never
    exist): their values are 0. A piece keeps the batch's `pad_to_multiple_of` (its width is rounded up to it).
    With `router_aux`, each piece's load-balancing loss is kept, and their mean returned. With `images` (a
    vision-language model), each piece gets its rows' pixel inputs and the suppressed tokens' logits are
    SUPPRESSED."""
    s = settings
    trees = "trees" in s.layouts and not s.router_aux  # router losses are computed over whole padded sequences
    setup = TreeSetup.of(model, batch.prompt_ids.device) if trees else None
    lengths = batch.completion_attention.sum(-1)
    logps: torch.Tensor | None = None
    entropies: torch.Tensor | None = None
    aux_losses: list[torch.Tensor] = []
    used: list[str] = []
    for rows in _pieces(lengths, s.chunk_size):
        part = batch.select(rows).trim(batch.padded_width(max(int(lengths[rows].max()), 1)))
        piece = pick(model, part, s, setup)
        outputs, aux_loss = LAYOUTS[piece.layout].forward(model, piece)
        lp, ent = _piece_logps(model, part, outputs, s)
        where = (rows.unsqueeze(1), torch.arange(lp.shape[1], device=rows.device))
        logps = (lp.new_zeros(batch.completion_ids.shape) if logps is None else logps).index_put(where, lp)
        if s.with_entropy:
            assert ent is not None
            entropies = ent.new_zeros(batch.completion_ids.shape) if entropies is None else entropies
            entropies = entropies.index_put(where, ent)
        used.append(piece.layout)
        if aux_loss is not None:
            aux_losses.append(aux_loss)
    assert logps is not None  # one piece at least
    return PassOutput(logps, entropies, torch.stack(aux_losses).mean() if aux_losses else None, tuple(used))


def _piece_logps(
    model: Any, part: TrainBatch, outputs: torch.Tensor, settings: PassSettings
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The piece's log-probs and entropies from its layout's outputs: logits, or with the tiled head the hidden
    states the head projects a chunk at a time (the image placeholders' logits SUPPRESSED either way)."""
    temperature, with_entropy, entropy_grad = settings.temperature, settings.with_entropy, settings.entropy_grad
    suppressed = settings.images.suppressed if settings.images is not None else ()
    if settings.chunked_head:
        head = unwrap(model).get_output_embeddings()
        dtype = torch.float32 if is_fp32_head(head) else None  # cast_lm_head_to_fp32: project in float32
        bias = head.bias
        if suppressed:  # the head's bias with SUPPRESSED at those tokens: their logits without a (B, T, V) copy
            bias = head.weight.new_zeros(head.weight.shape[0]) if bias is None else bias.clone()
            bias[list(suppressed)] = SUPPRESSED
        attended = part.completion_attention.bool()  # padding's log-probs are never read: not projected (0 there)
        real = None if bool(attended.all()) else attended
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
