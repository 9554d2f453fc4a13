"""The training batch: a generation's rollouts as padded tensors, and the model pass that scores them.

Layout (shared spec §2.1): prompt ids left-padded, completion ids right-padded, concatenated. Position ids
come from the attention mask, as in generation, so left padding never shifts a token's position.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from grpo.generation import Rollout, accepts_logits_to_keep, cache_argument, left_pad, right_pad
from grpo.logprobs import chunked_logps_and_entropy, logps_and_entropy
from grpo.runtime import recomputes_activations


@dataclass
class TrainBatch:
    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P)
    completion_ids: torch.Tensor  # (B, C) right-padded
    completion_attention: torch.Tensor  # (B, C) 1 on completion tokens the model attends to
    mask: torch.Tensor  # (B, C) float, 1 on tokens the loss trains
    advantages: torch.Tensor  # (B,)
    sampling_logps: torch.Tensor  # (B, C) the sampler's log-probs (0 on padding)
    truncated: torch.Tensor  # (B,) bool
    group: torch.Tensor  # (B,) prompt id: rows with the same id share the same prompt tokens
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def select(self, rows: torch.Tensor | slice) -> TrainBatch:
        return TrainBatch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
                             for f in dataclasses.fields(self)})

    def trim(self, width: int) -> TrainBatch:
        """Keep the first `width` completion positions (dropping padding columns)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("completion_ids", "completion_attention", "mask", "sampling_logps", "old_logps", "ref_logps"):
            if fields[name] is not None:
                fields[name] = fields[name][:, :width]
        return TrainBatch(**fields)

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                             for f in dataclasses.fields(self)})


def collate(rollout: Rollout, advantages: torch.Tensor, pad_id: int, mask_truncated: bool,
            group: torch.Tensor | None = None) -> TrainBatch:
    prompt_ids, prompt_mask = left_pad(rollout.prompt_ids, pad_id)
    completion_ids = right_pad(rollout.completion_ids, pad_id)
    attention = right_pad([[1] * len(c) for c in rollout.completion_ids], 0)
    loss_mask = right_pad(rollout.loss_mask, 0)
    truncated = torch.tensor(rollout.truncated, dtype=torch.bool)
    if mask_truncated:
        # truncated rows leave the loss, the token count and attention (shared spec §10.2)
        attention = attention * (~truncated).long().unsqueeze(1)
    return TrainBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_attention=attention,
        mask=(attention * loss_mask).float(),
        advantages=advantages.float(),
        sampling_logps=right_pad(rollout.sampling_logps, 0.0, dtype=torch.float32),
        truncated=truncated,
        group=group if group is not None else torch.arange(len(rollout.prompt_ids)),
    )


def token_logps(model: Any, batch: TrainBatch, temperature: float, with_entropy: bool = True,
                chunk_size: int | None = None, entropy_grad: bool = False, share_prefix: bool = False,
                chunked_head: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
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
    with grouped_kv_attention(model):
        for rows in _pieces(lengths, chunk_size):
            part = batch.select(rows).trim(max(int(lengths[rows].max()), 1))
            lp, ent = _piece_logps(model, part, forward, temperature, with_entropy, entropy_grad, chunked_head)
            where = (rows.unsqueeze(1), torch.arange(lp.shape[1], device=rows.device))
            logps = (lp.new_zeros(batch.completion_ids.shape) if logps is None else logps).index_put(where, lp)
            if with_entropy:
                entropies = (ent.new_zeros(batch.completion_ids.shape) if entropies is None else entropies)
                entropies = entropies.index_put(where, ent)
    return logps, entropies


def _piece_logps(model, part, forward, temperature, with_entropy, entropy_grad, chunked_head):
    outputs = forward(model, part, chunked_head)
    if chunked_head:
        head = _unwrap(model).get_output_embeddings()
        return chunked_logps_and_entropy(outputs, head.weight, head.bias, part.completion_ids, temperature,
                                         with_entropy, entropy_grad)
    return logps_and_entropy(outputs / temperature, part.completion_ids, with_entropy, entropy_grad)


@contextlib.contextmanager
def grouped_kv_attention(model: Any):
    """On CPU, let transformers' SDPA attention read the key/value heads as they are (enable_gqa) instead of
    repeating them for every query head: CPU's flash kernel takes grouped heads with a mask and gives the same
    numbers (tested), ~15% faster, without the repeated keys and values the backward would keep. (On CUDA a mask
    would send grouped heads to the slow math kernel, so elsewhere this does nothing. Nor with gradient
    checkpointing: its recomputation in backward runs outside this context and must see the same tensors.)"""
    model = _unwrap(model)
    config = getattr(model, "config", None)
    grouped = getattr(config, "num_key_value_heads", None) not in (None, getattr(config, "num_attention_heads", None))
    cpu = next(model.parameters()).device.type == "cpu"
    recomputes = recomputes_activations(model)
    if not grouped or not cpu or recomputes or "TRANSFORMERS_SDPA_FORCE_GQA" in os.environ:
        yield
        return
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"  # read by transformers' sdpa_attention_forward at each call
    try:
        yield
    finally:
        del os.environ["TRANSFORMERS_SDPA_FORCE_GQA"]


def _pieces(lengths: torch.Tensor, chunk_size: int | None) -> list[torch.Tensor]:
    """Row indices sorted by completion length, cut into chunk_size pieces (one piece when None).

    Sorting makes each piece's rows alike in length, so trimming pads less. Splitting an unchunked batch
    further was measured slower on CPU (one more forward costs more than the padding it saves)."""
    order = torch.argsort(lengths, stable=True)
    return list(order.split(chunk_size)) if chunk_size else [order]


def head_is_chunkable(model: Any) -> bool:
    """A plain linear output head with nothing applied after it (no logit soft-capping or scaling), and not its own
    FSDP unit: the tiled kernel reads the head's weight outside the head's forward, and FSDP frees a unit's
    gathered weight when its forward ends (a head sharded with the root unit stays gathered, and is fine); nor
    partitioned by DeepSpeed ZeRO-3, which likewise releases it after the head's forward."""
    from torch.distributed.fsdp import FSDPModule

    from grpo.zero import is_partitioned

    model = _unwrap(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    scaled = any(getattr(config, name, None) for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    return (isinstance(head, torch.nn.Linear) and not scaled and not isinstance(head, FSDPModule)
            and not is_partitioned(head))


def _outputs(model: Any, chunked_head: bool, **inputs: Any) -> torch.Tensor:
    """The model's logits (B, T, V), or with `chunked_head` the hidden states its output head would have
    projected (B, T, H): a pre-hook captures them and hands the head an empty slice, so no logits are made."""
    if not chunked_head:
        return model(**inputs).logits
    captured = {}

    def skip_head(module, args):
        captured["hidden"] = args[0]
        return (args[0][..., :0, :],) + tuple(args[1:])

    handle = _unwrap(model).get_output_embeddings().register_forward_pre_hook(skip_head)
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
    kwargs = {"logits_to_keep": c + 1} if accepts_logits_to_keep(_unwrap(model)) else {}
    out = _outputs(model, chunked_head, input_ids=input_ids, attention_mask=attention, position_ids=position_ids,
                   use_cache=False, **kwargs)
    return out[:, -(c + 1):-1, :]  # position t predicts completion token t


def _forward_shared(model: Any, batch: TrainBatch, chunked_head: bool = False) -> torch.Tensor:
    """The same outputs as `_forward`, running each distinct prompt once.

    The prompt pass fills a KV cache (with gradient), whose rows are copied to the completions of that prompt;
    the completions then attend to it. Causal attention makes this exact: a prompt token never sees the
    completion, so its keys and values are the same for all G rows, and autograd sums their gradients back.
    With prompts longer than completions this removes most of the training pass's work."""
    groups, inverse = torch.unique(batch.group, return_inverse=True)
    # one row per prompt (which one does not matter: all rows of a group hold the same prompt tokens)
    first = torch.empty(len(groups), dtype=torch.long, device=inverse.device).scatter_(
        0, inverse, torch.arange(len(inverse), device=inverse.device))
    prompt_mask = batch.prompt_mask[first]
    cache = DynamicCache()
    cache_arg = cache_argument(_unwrap(model))
    prompt_positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    last = _outputs(model, chunked_head, input_ids=batch.prompt_ids[first], attention_mask=prompt_mask,
                    position_ids=prompt_positions, use_cache=True, logits_to_keep=1, **{cache_arg: cache})
    cache.batch_select_indices(inverse)
    attention = torch.cat([batch.prompt_mask, batch.completion_attention], dim=1)
    c = batch.completion_ids.shape[1]
    positions = batch.prompt_mask.sum(-1, keepdim=True) + torch.arange(c, device=attention.device)
    rest = _outputs(model, chunked_head, input_ids=batch.completion_ids, attention_mask=attention,
                    position_ids=positions, use_cache=True, **{cache_arg: cache})
    return torch.cat([last[inverse, -1:, :], rest[:, :-1, :]], dim=1)


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    return model
