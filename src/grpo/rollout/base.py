"""The rollout interface: what the trainer asks of a generation engine, and what it gets back.

    rollout = engine.generate([Request(prompt, num_samples=G), ...])   # a request's samples: consecutive rows
    engine.sync_weights(model)                                         # before generating with newer weights

The records it speaks in (`Prompt`, `Request`, `Rollout`) are plain ones, at the bottom layer
(`grpo.base.records`). A `Rollout` holds one row per completion, request by request. Every engine keeps the sampled
tokens' log-probs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from grpo.base.records import Request, Rollout


class Engine(Protocol):
    """A generation engine. `generate` answers the requests in order, the samples of a request in consecutive
    rows; `sync_weights` makes the engine sample from `model`'s current weights (a no-op for engines that sample
    from the training model itself)."""

    name: str

    def generate(self, requests: Sequence[Request]) -> Rollout: ...

    def sync_weights(self, model: torch.nn.Module) -> None: ...


def cut_at_stop(tokens: list[int], stop_ids: set[int]) -> tuple[list[int], bool]:
    """Keep tokens up to and including the first stop token; report whether none came (truncated)."""
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: i + 1], False
    return tokens, True


def assemble(
    rows: Sequence[Request],
    completion_ids: list[list[int]],
    sampling_logps: list[list[float]],
    stop_ids: set[int],
    tokenizer: Any,
) -> Rollout:
    """A Rollout from each row's sampled tokens (cut after the first stop token) and their log-probs: truncated
    where no stop token ended it, decoded once, and as one assistant message for conversational prompts."""
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return Rollout(
        prompt_ids=[list(row.prompt.ids) for row in rows],
        completion_ids=completion_ids,
        sampling_logps=sampling_logps,
        truncated=[not ids or ids[-1] not in stop_ids for ids in completion_ids],
        texts=texts,
        messages=[
            [{"role": "assistant", "content": text}] if row.prompt.is_conversational else None
            for row, text in zip(rows, texts)
        ],
        vision=[row.prompt for row in rows] if any(row.prompt.images for row in rows) else [],
    )
