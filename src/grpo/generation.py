"""Generation engines: prompts (token ids) in, completions with their sampling log-probs out.

Every engine returns a `Rollout`; the trainer does not care which engine made it. Engines to come (a
generation server, vLLM) implement the same `generate(prompt_ids) -> Rollout`.

`TransformersEngine` samples in-process with `model.generate`, the plain path: it honours every
`generation_kwargs` key transformers knows. Each sampled token's log-probability is taken from the processed
scores (after temperature and every logits processor), the quantity vLLM calls "processed logprobs".
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import torch
from transformers import GenerationConfig

from grpo.modeling import base_model


@dataclass
class Rollout:
    """One completion per prompt row. Lists are per row, ragged (no padding)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # ends with its stop token unless truncated
    sampling_logps: list[list[float]]  # log-prob of each sampled token under the sampler's distribution
    truncated: list[bool]  # stopped by max_completion_length rather than a stop token
    loss_mask: list[list[int]] = field(default_factory=list)  # 0 on tokens not to train (tool results); default 1

    def __post_init__(self) -> None:
        if not self.loss_mask:
            self.loss_mask = [[1] * len(ids) for ids in self.completion_ids]

    def __len__(self) -> int:
        return len(self.completion_ids)

    def select(self, rows: Sequence[int]) -> Rollout:
        return Rollout(**{f.name: [getattr(self, f.name)[i] for i in rows] for f in fields(self)})

    @staticmethod
    def concat(parts: Sequence[Rollout]) -> Rollout:
        return Rollout(**{f.name: [x for part in parts for x in getattr(part, f.name)] for f in fields(Rollout)})


class GenerationEngine(Protocol):
    def generate(self, prompt_ids: Sequence[Sequence[int]]) -> Rollout: ...


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) with rows right-aligned, the layout decoder-only generation needs."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
    return ids, mask


def right_pad(rows: Sequence[Sequence[Any]], pad: Any, dtype: torch.dtype = torch.long) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, :len(r)] = torch.tensor(r, dtype=dtype)
    return out


def _forward_parameters(model: Any) -> Any:
    """The keyword parameters of the transformers model's own forward, looking through DDP and PEFT wrappers
    (which pass keywords on)."""
    return inspect.signature(base_model(model).forward).parameters


def accepts_logits_to_keep(model: Any) -> bool:
    """Whether the model's forward can skip computing logits for positions we do not need."""
    try:
        return "logits_to_keep" in _forward_parameters(model)
    except (TypeError, ValueError, AttributeError):
        return False


def cache_argument(model: Any) -> str:
    """The forward keyword that takes a KV cache: `cache` (transformers >= 5.2x) or `past_key_values`."""
    try:
        return "cache" if "cache" in _forward_parameters(model) else "past_key_values"
    except (TypeError, ValueError, AttributeError):
        return "past_key_values"


def cut_at_stop(tokens: list[int], stop_ids: set[int]) -> tuple[list[int], bool]:
    """Keep tokens up to and including the first stop token; report whether none came (truncated)."""
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[:i + 1], False
    return tokens, True


def sampling_config(args: Any, stop_ids: list[int], pad_id: int) -> GenerationConfig:
    """The generation parameters of GRPOConfig, with `generation_kwargs` applied over them."""
    params = dict(max_new_tokens=args.max_completion_length, do_sample=True, temperature=args.temperature,
                  top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                  eos_token_id=stop_ids, pad_token_id=pad_id, cache_implementation=args.cache_implementation,
                  output_scores=True, return_dict_in_generate=True)
    params.update(args.generation_kwargs or {})
    return GenerationConfig(**params)


class TransformersEngine:
    """Samples with `model.generate` on the given (unwrapped) model, in eval mode and without gradients."""

    def __init__(self, model: Any, args: Any, stop_ids: list[int], pad_id: int,
                 autocast: Any = None, batch_size: int | None = None) -> None:
        self.model = model
        self.stop_ids = set(stop_ids)
        self.pad_id = pad_id
        self.config = sampling_config(args, stop_ids, pad_id)
        self.max_new_tokens = args.max_completion_length
        self.autocast = autocast
        self.batch_size = batch_size

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[Sequence[int]]) -> Rollout:
        step = self.batch_size or len(prompt_ids)
        parts = [self._generate(prompt_ids[i:i + step]) for i in range(0, len(prompt_ids), step)]
        return Rollout(
            prompt_ids=[list(p) for p in prompt_ids],
            completion_ids=[c for part in parts for c in part.completion_ids],
            sampling_logps=[lp for part in parts for lp in part.sampling_logps],
            truncated=[t for part in parts for t in part.truncated],
        )

    def _generate(self, prompt_ids: Sequence[Sequence[int]]) -> Rollout:
        device = next(self.model.parameters()).device
        ids, mask = left_pad(prompt_ids, self.pad_id)
        was_training = self.model.training
        self.model.eval()  # dropout off, and the KV cache on even when gradient checkpointing is enabled
        try:
            with self.autocast() if self.autocast else nullcontext():
                out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                          generation_config=self.config)
        finally:
            self.model.train(was_training)
        new_tokens = out.sequences[:, ids.shape[1]:]
        # scores[t] are the processed logits the token at step t was drawn from; one step at a time keeps the
        # extra memory at (B, V)
        token_logps = torch.stack([torch.log_softmax(s.float(), dim=-1).gather(-1, new_tokens[:, t, None])[:, 0]
                                   for t, s in enumerate(out.scores)], dim=1)
        completions, logps, truncated = [], [], []
        for row, row_logps in zip(new_tokens.tolist(), token_logps.tolist()):
            kept, was_cut = cut_at_stop(row, self.stop_ids)
            completions.append(kept)
            logps.append(row_logps[:len(kept)])
            truncated.append(was_cut)
        return Rollout(prompt_ids=[list(p) for p in prompt_ids], completion_ids=completions,
                       sampling_logps=logps, truncated=truncated)

