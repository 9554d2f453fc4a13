"""The training pass: token log-probs (and entropies) of a `TrainBatch`'s completions under a model.

`TrainingPass` holds the choices made once per run from the model and config, each logged when it does not apply:
- prefix sharing: the rows of one prompt run the prompt once (exact; needs the KV cache, which gradient
  checkpointing turns off, and a cache that can select rows);
- the tiled output head (`grpo.logprobs.chunked_logps_and_entropy`): the (B, T, V) logits never exist;
- the memory-saving blocks and, opt-in (`lean_linears`), linears of `grpo.perf`, around the gradient pass only.
Position ids follow the attention mask, as in generation, so left padding never shifts a token's position.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import DynamicCache

from grpo.batch import TrainBatch
from grpo.distributed.zero import is_partitioned
from grpo.logprobs import chunked_logps_and_entropy, logps_and_entropy
from grpo.modeling import accepts_logits_to_keep, cache_argument, recomputes_activations, unwrap
from grpo.perf import blocks, linears

logger = logging.getLogger("grpo")


class TrainingPass:
    """How this run scores completions; `logps` for the no-gradient passes (old policy, reference), `train` for the
    pass that is backpropagated."""

    def __init__(self, model: Any, args: Any, autocast: Any, mixed_precision: str) -> None:
        self.temperature = args.temperature
        self.autocast = autocast
        reason = prefix_sharing_unsupported_reason(model)
        if reason is not None:
            logger.info("Training pass runs each row's prompt itself: %s.", reason)
        self.share_prefix = reason is None
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
        if reason is not None:
            logger.info("Training pass keeps the model's own blocks: %s.", reason)
        self.lean_blocks = reason is None

    def logps(self, model: Any, batch: TrainBatch, chunk_size: int | None = None) -> torch.Tensor:
        """Token log-probs without gradient, under the run's precision, `chunk_size` rows at a time."""
        with torch.no_grad(), self.autocast():
            logps, _ = token_logps(
                model,
                batch,
                self.temperature,
                with_entropy=False,
                chunk_size=chunk_size,
                share_prefix=self.share_prefix,
                chunked_head=self.chunked_head,
            )
        return logps

    def train(self, model: Any, batch: TrainBatch, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Token log-probs and entropies with gradient (entropies only with `entropy_grad`)."""
        lean = linears.lean_linears(model, self.lean_dtype) if self.lean_dtype else contextlib.nullcontext()
        kept = blocks.lean_blocks(model) if self.lean_blocks else contextlib.nullcontext()
        with self.autocast(), lean, kept:
            return token_logps(
                model,
                batch,
                self.temperature,
                with_entropy=True,
                entropy_grad=entropy_grad,
                share_prefix=self.share_prefix,
                chunked_head=self.chunked_head,
            )


def prefix_sharing_unsupported_reason(model: Any) -> str | None:
    """Why the rows of one prompt cannot share the prompt's pass (None when they can)."""
    inner = unwrap(model)
    if recomputes_activations(model):
        return "gradient checkpointing turns the KV cache off"
    if not getattr(inner, "_supports_cache_class", True) or getattr(inner.config, "is_encoder_decoder", False):
        return "the model does not use transformers' dynamic KV cache"
    return None


def token_logps(
    model: Any,
    batch: TrainBatch,
    temperature: float,
    with_entropy: bool = True,
    chunk_size: int | None = None,
    entropy_grad: bool = False,
    share_prefix: bool = False,
    chunked_head: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the completion tokens under `model` (logits divided by temperature), and their entropies,
    as (B, C) tensors (values on padding positions are meaningless: the mask removes them).

    Rows are sorted by completion length and cut into pieces of `chunk_size` rows (one piece when None); each
    piece is trimmed to its own longest completion, so short completions do not pay for a long one's padding.
    Padding never changes a real token's outputs (causal attention, masked keys), so this is exact. Entropies
    carry a gradient only with `entropy_grad` (the entropy bonus). With `share_prefix`, rows of one prompt run
    the prompt once (see `_forward_shared`). With `chunked_head`, the output projection runs inside
    `chunked_logps_and_entropy`, a chunk of tokens at a time, and the (B, T, V) logits never exist."""
    forward = _forward_shared if share_prefix else _forward
    lengths = batch.completion_attention.sum(-1)
    logps = entropies = None
    for rows in _pieces(lengths, chunk_size):
        part = batch.select(rows).trim(max(int(lengths[rows].max()), 1))
        lp, ent = _piece_logps(model, part, forward, temperature, with_entropy, entropy_grad, chunked_head)
        where = (rows.unsqueeze(1), torch.arange(lp.shape[1], device=rows.device))
        logps = (lp.new_zeros(batch.completion_ids.shape) if logps is None else logps).index_put(where, lp)
        if with_entropy:
            entropies = ent.new_zeros(batch.completion_ids.shape) if entropies is None else entropies
            entropies = entropies.index_put(where, ent)
    return logps, entropies


def _piece_logps(model, part, forward, temperature, with_entropy, entropy_grad, chunked_head):
    outputs = forward(model, part, chunked_head)
    if chunked_head:
        head = unwrap(model).get_output_embeddings()
        return chunked_logps_and_entropy(
            outputs, head.weight, head.bias, part.completion_ids, temperature, with_entropy, entropy_grad
        )
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


def _outputs(model: Any, chunked_head: bool, **inputs: Any) -> torch.Tensor:
    """The model's logits (B, T, V), or with `chunked_head` the hidden states its output head would have
    projected (B, T, H): a pre-hook captures them and hands the head an empty slice, so no logits are made."""
    if not chunked_head:
        return model(**inputs).logits
    captured = {}

    def skip_head(module, args):
        captured["hidden"] = args[0]
        return (args[0][..., :0, :],) + tuple(args[1:])

    handle = unwrap(model).get_output_embeddings().register_forward_pre_hook(skip_head)
    try:
        model(**inputs)
    finally:
        handle.remove()
    return captured["hidden"]


def _forward(model: Any, batch: TrainBatch, chunked_head: bool = False) -> torch.Tensor:
    """Outputs predicting each completion token, (B, C, V or H), from one pass over prompt + completion."""
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attention = torch.cat([batch.prompt_mask, batch.completion_attention], dim=1)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    c = batch.completion_ids.shape[1]
    kwargs = {"logits_to_keep": c + 1} if accepts_logits_to_keep(unwrap(model)) else {}
    out = _outputs(
        model,
        chunked_head,
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=position_ids,
        use_cache=False,
        **kwargs,
    )
    return out[:, -(c + 1) : -1, :]  # position t predicts completion token t


def _forward_shared(model: Any, batch: TrainBatch, chunked_head: bool = False) -> torch.Tensor:
    """The same outputs as `_forward`, running each distinct prompt once.

    The prompt pass fills a KV cache (with gradient), whose rows are copied to the completions of that prompt;
    the completions then attend to it. Causal attention makes this exact: a prompt token never sees the
    completion, so its keys and values are the same for all G rows, and autograd sums their gradients back.
    With prompts longer than completions this removes most of the training pass's work."""
    groups, inverse = torch.unique(batch.group, return_inverse=True)
    # one row per prompt (which one does not matter: all rows of a group hold the same prompt tokens)
    first = torch.empty(len(groups), dtype=torch.long, device=inverse.device).scatter_(
        0, inverse, torch.arange(len(inverse), device=inverse.device)
    )
    prompt_mask = batch.prompt_mask[first]
    cache = DynamicCache()
    cache_arg = cache_argument(unwrap(model))
    prompt_positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    last = _outputs(
        model,
        chunked_head,
        input_ids=batch.prompt_ids[first],
        attention_mask=prompt_mask,
        position_ids=prompt_positions,
        use_cache=True,
        logits_to_keep=1,
        **{cache_arg: cache},
    )
    cache.batch_select_indices(inverse)
    attention = torch.cat([batch.prompt_mask, batch.completion_attention], dim=1)
    c = batch.completion_ids.shape[1]
    positions = batch.prompt_mask.sum(-1, keepdim=True) + torch.arange(c, device=attention.device)
    rest = _outputs(
        model,
        chunked_head,
        input_ids=batch.completion_ids,
        attention_mask=attention,
        position_ids=positions,
        use_cache=True,
        **{cache_arg: cache},
    )
    return torch.cat([last[inverse, -1:, :], rest[:, :-1, :]], dim=1)
