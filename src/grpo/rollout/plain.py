"""`TransformersEngine`: samples in-process with `model.generate`, the plain path.

It honours every `generation_kwargs` key transformers knows. Each sampled token's log-probability is taken from
the processed scores (after temperature and every logits processor), the quantity vLLM calls "processed
logprobs".
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from grpo.base import sigterm
from grpo.rollout.base import Request, Rollout, assemble, cut_at_stop, expand, left_pad


def sampling_config(args: Any, stop_ids: list[int], pad_id: int) -> GenerationConfig:
    """The generation parameters of GRPOConfig, with `generation_kwargs` applied over them."""
    params = dict(
        max_new_tokens=args.max_completion_length,
        do_sample=True,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
        cache_implementation=args.cache_implementation,
        output_scores=True,
        return_dict_in_generate=True,
    )
    params.update(args.generation_kwargs or {})
    return GenerationConfig(**params)


# a suppressed token's logit where the engine cannot leave it out: its probability underflows to exactly 0 in
# float32, and (unlike -inf) its entropy term stays 0
SUPPRESSED = -1e4


def suppressed_tokens(model: Any) -> list[int]:
    """A vision-language model's image placeholder token(s): never sampled (shared spec §5.4)."""
    config = getattr(model, "config", None)
    return [
        i for i in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None)) if i is not None
    ]


class _StopOnPreemption(StoppingCriteria):
    """Ends `model.generate` at the next token once SIGTERM has arrived (the engine then raises `Preempted`)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), sigterm.requested(), dtype=torch.bool, device=input_ids.device)


def _token_logps(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(rows,) log-probs of `tokens` under one step's (rows, vocabulary) processed scores."""
    return torch.log_softmax(scores.float(), dim=-1).gather(-1, tokens[:, None])[:, 0]


class _SampledLogps(StoppingCriteria):
    """After each step, the log-probability of the token just sampled, read from that step's processed scores (the
    last of generate's `scores`); then those scores' memory is released. generate would otherwise keep every
    step's (rows, vocabulary) float32 scores until it returns: 256 rows x 1,024 steps at a 152k vocabulary is
    ~159 GB. Never stops generation itself."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(scores, tuple) and scores and scores[-1].numel():
            self.steps.append(_token_logps(scores[-1], input_ids[:, -1]))
            scores[-1].set_()  # generate's tuple keeps the tensor object, no longer its (rows, vocabulary) memory
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def logps(self, new_tokens: torch.Tensor, scores: Any) -> torch.Tensor:
        """(rows, steps) log-probs of `new_tokens`: the steps read as they came (a deferred stop check may have
        run steps that generate then undid: only the first ones count), else from scores generate returned whole
        (a decoding loop that does not hand its criteria the scores), else NaN (no sampling correction)."""
        count = new_tokens.shape[1]
        steps = self.steps
        if len(steps) < count and scores is not None and len(scores) >= count and all(s.numel() for s in scores):
            steps = [_token_logps(s, new_tokens[:, t]) for t, s in enumerate(scores[:count])]
        if len(steps) < count:
            return torch.full(new_tokens.shape, float("nan"))
        return torch.stack(steps[:count], dim=1) if count else torch.zeros(new_tokens.shape)


class TransformersEngine:
    """Samples with `model.generate` on the given (unwrapped) model, in eval mode and without gradients."""

    name = "transformers"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        args: Any,
        stop_ids: list[int],
        autocast: Any = None,
        batch_size: int | None = None,
        pixels: Any = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.config = sampling_config(args, stop_ids, tokenizer.pad_token_id)
        self.max_new_tokens = self.config.max_new_tokens  # generation_kwargs may set it
        self.autocast = autocast
        self.batch_size = batch_size
        self.pixels = pixels  # a vision-language model's image inputs (`grpo.models.vision.Pixels`)
        if pixels is not None:  # a sampled image token would have no image features (the training pass agrees)
            self.config.suppress_tokens = [*(self.config.suppress_tokens or []), *suppressed_tokens(model)]

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Nothing to do: the engine samples from the training model itself."""

    @torch.no_grad()
    def generate(self, requests: Sequence[Request]) -> Rollout:
        rows = expand(requests)
        step = self.batch_size or len(rows)
        completions, logps = [], []
        for start in range(0, len(rows), step):
            part_ids, part_logps = self._generate(rows[start : start + step])
            completions += part_ids
            logps += part_logps
        return assemble(rows, completions, logps, self.stop_ids, self.tokenizer)

    def _generate(self, rows: Sequence[Request]) -> tuple[list[list[int]], list[list[float]]]:
        device = next(self.model.parameters()).device
        ids, mask = left_pad([row.prompt.ids for row in rows], self.tokenizer.pad_token_id)
        budgets = [row.max_tokens or self.max_new_tokens for row in rows]
        images = {}
        if self.pixels is not None:
            images = self.pixels.inputs([row.prompt for row in rows], ids.to(device), device)
        was_training = self.model.training
        self.model.eval()  # dropout off, and the KV cache on even when gradient checkpointing is enabled
        sampled = _SampledLogps()
        try:
            with self.autocast() if self.autocast else nullcontext():
                out = self.model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    **images,
                    generation_config=self.config,
                    max_new_tokens=max(budgets),
                    stopping_criteria=StoppingCriteriaList([_StopOnPreemption(), sampled]),
                )
        finally:
            self.model.train(was_training)
        sigterm.check()
        if isinstance(out, torch.Tensor):  # a replaced generate returning sequences only: tokens the engine did not
            new_tokens = out[:, ids.shape[1] :]  # score (NaN log-probs: no sampling correction, as vLLM's unscored)
            token_logps = torch.full(new_tokens.shape, float("nan"))
        else:  # from the processed scores each token was drawn from (after temperature and every logits processor)
            new_tokens = out.sequences[:, ids.shape[1] :]
            token_logps = sampled.logps(new_tokens, out.scores)
        completions, logps = [], []
        for row, row_logps, budget in zip(new_tokens.tolist(), token_logps.tolist(), budgets):
            kept, _ = cut_at_stop(row[:budget], self.stop_ids)
            completions.append(kept)
            logps.append(row_logps[: len(kept)])
        return completions, logps
