"""Prefix sharing: whether the rows of one prompt group can share the prompt's pass, which rows hold the same prompt
(`shared_prompts`: by its tokens, never by its group id alone), and the row copies that share it. Each row takes a
copy of its prompt's KV cache and last output, with a backward that adds the copies' gradients in the same order on
every run.

transformers' `Cache.batch_select_indices` copies rows by advanced indexing (`keys[indices]`). On the CPU with more
than one thread, that indexing's backward adds the copies' gradients with atomic float adds, in whichever order the
threads reach them (torch lists `Tensor.__getitem__`'s CPU backward among its nondeterministic operations). The same
batch then gave gradients a rounding apart from one run to the next, and a resumed run was not bit-identical to the
uninterrupted one. `take_rows` copies rows through an embedding lookup instead: its backward is deterministic on the
CPU and on CUDA, and it computes the same sums. The token-tree and forked-turn layouts read their rows' positions
through it too (a tree's prompt end is every row's first position).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from grpo.learner.batch import TrainBatch
from grpo.models.modeling import keeps_recurrent_state, recomputes_activations, unwrap


def prefix_sharing_unsupported_reason(model: Any) -> str | None:
    """Why the rows of one prompt cannot share the prompt's pass (None when they can)."""
    inner = unwrap(model)
    if recomputes_activations(model):
        return "gradient checkpointing turns the KV cache off"
    if not getattr(inner, "_supports_cache_class", True) or getattr(inner.config, "is_encoder_decoder", False):
        return "the model does not use transformers' dynamic KV cache"
    # Qwen3.5, NemotronH, ...: a plain DynamicCache has no place for their layers' state, and transformers' cache
    # layers for it write the state in place, which a gradient pass through the rows cannot backpropagate
    if keeps_recurrent_state(inner):
        return "the model keeps recurrent state (Mamba or linear-attention layers), which a KV cache does not hold"
    return None


def shared_prompts(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows that hold each distinct prompt of `batch`, one each (`first`), and each row's prompt among them
    (`inverse`): rows share a prompt where their group (`TrainBatch.group`) and prompt tokens (ids and length) are
    equal. A group id alone is not enough: a rollout_func returns prompt ids per sample and may give a group's
    samples different ones (a per-sample hint). Rows keep their groups' order, so a batch whose groups hold one
    prompt each shares exactly as by its group ids."""
    mask = batch.prompt_mask.long()
    key = torch.cat([batch.group.long().unsqueeze(1), mask, batch.prompt_ids.long() * mask], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    count = int(inverse.max()) + 1 if len(inverse) else 0
    first = torch.empty(count, dtype=torch.long, device=inverse.device).scatter_(
        0, inverse, torch.arange(len(inverse), device=inverse.device)
    )
    return first, inverse


# the cache layers whose state is their keys and values alone; any other kind selects its own rows
_KEYS_AND_VALUES = (DynamicLayer, DynamicSlidingWindowLayer)


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x[index]` along the first dimension (`index`, of any shape, may repeat rows), with a deterministic backward."""
    flat = x.reshape(x.shape[0], -1)
    return torch.nn.functional.embedding(index, flat).view(*index.shape, *x.shape[1:])


def select_cache_rows(cache: Any, index: torch.Tensor) -> None:
    """`cache.batch_select_indices(index)`, through `take_rows` for transformers' plain and sliding-window layers."""
    for layer in cache.layers:
        if type(layer) not in _KEYS_AND_VALUES:
            layer.batch_select_indices(index)
        elif layer.get_seq_length() > 0:
            layer.keys = take_rows(layer.keys, index)
            layer.values = take_rows(layer.values, index)
