"""The plain records that pass between the layers: a tokenized `Prompt`, a `Request` for completions of one, the
`Rollout` an engine returns (one row per completion, with everything the training pass and the reward functions
need), and token rows padded into tensors.

A `Prompt` is tokenized once (`grpo.data.prompts.PromptSource`) and carries what it came from: the messages of a
conversational prompt, and room for images. A `Request` asks for `num_samples` completions of one prompt (G for a
fresh prompt, or a process's share of them; 1 for a follow-up turn of a multi-turn rollout), optionally with a
smaller token budget. The generation engines (`grpo.rollout`) answer requests with rollouts; the data, the tool
loop, the reward functions and the learner read them without importing an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch


@dataclass(frozen=True)
class Prompt:
    """One prompt, tokenized. `messages` is set for conversational prompts; `images` for image prompts (their
    blocks are in `messages` too), whose rendered `text` the processor reads with them (`grpo.models.vision`)."""

    ids: tuple[int, ...]
    messages: tuple[dict, ...] | None = None
    images: tuple[Any, ...] | None = None
    text: str | None = field(default=None, compare=False)
    # how many of `ids` `text` renders (None: all): a tool loop's next turn continues an image prompt
    text_tokens: int | None = field(default=None, compare=False)
    # a tool loop's next turn: its tokens with one placeholder per image, unexpanded (what vLLM expands itself)
    placeholder_ids: tuple[int, ...] | None = field(default=None, compare=False)

    @property
    def is_conversational(self) -> bool:
        return self.messages is not None

    def unexpanded_ids(self, tokenizer: Any) -> list[int]:
        """The tokens with one placeholder per image, before a processor expands them (what vLLM expands itself): a
        tool loop's `placeholder_ids`, an image prompt's rendered text tokenized as it is, else `ids`."""
        if self.placeholder_ids is not None:
            return list(self.placeholder_ids)
        if self.images and self.text is not None:
            return tokenizer(self.text, add_special_tokens=False)["input_ids"]
        return list(self.ids)


@dataclass(frozen=True)
class Request:
    """`num_samples` completions of `prompt`, each at most `max_tokens` long (None: the engine's limit)."""

    prompt: Prompt
    num_samples: int = 1
    max_tokens: int | None = None


# A multi-turn row sampled from rendered histories: its completion positions in spans, (start, end, context) each,
# the span's tokens sampled after `context` (every token before them, the prompt included)
Turns = tuple[tuple[int, int, tuple[int, ...]], ...]


@dataclass
class Rollout:
    """One row per completion, ragged lists (no padding)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # ends with its stop token unless truncated
    sampling_logps: list[list[float]]  # log-prob of each sampled token under the sampler's distribution
    truncated: list[bool]  # stopped by the token budget rather than a stop token
    texts: list[str] = field(default_factory=list)  # the completion decoded (special tokens skipped)
    # the completion as messages (conversational prompts), None for a standard prompt
    messages: list[list[dict] | None] = field(default_factory=list)
    loss_mask: list[list[int]] = field(default_factory=list)  # 1 = trained; 0 = not (tool results); default 1
    tool_calls: list[int] = field(default_factory=list)  # tool calls made in each completion (default 0)
    tool_failures: list[int] = field(default_factory=list)  # of which failed
    # where any row has images: each row's Prompt (the forward passes give the model their pixels); else None
    vision: list[Prompt | None] = field(default_factory=list)
    # the log-probs of the policy that sampled each row, a 1-d tensor each (an asynchronous producer's behaviour
    # policy: the learner's old_logps); None where not computed
    behaviour_logps: list[torch.Tensor | None] = field(default_factory=list)
    # a multi-turn row whose later turns were sampled from the conversation as the chat template renders it
    # (`turn_context`): its turns (`Turns`); None for a row that is one sequence, the prompt then the completion
    turns: list[Turns | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.loss_mask:
            self.loss_mask = [[1] * len(ids) for ids in self.completion_ids]
        if not self.tool_calls:
            self.tool_calls = [0] * len(self.completion_ids)
        if not self.tool_failures:
            self.tool_failures = [0] * len(self.completion_ids)
        if not self.texts:
            self.texts = [""] * len(self.completion_ids)
        if not self.messages:
            self.messages = [None] * len(self.completion_ids)
        if not self.vision:
            self.vision = [None] * len(self.completion_ids)
        if not self.behaviour_logps:
            self.behaviour_logps = [None] * len(self.completion_ids)
        if not self.turns:
            self.turns = [None] * len(self.completion_ids)

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def completions(self) -> list[str | list[dict]]:
        """What reward functions receive: the messages of a conversational completion, else its text."""
        return [text if messages is None else messages for text, messages in zip(self.texts, self.messages)]

    def select(self, rows: Sequence[int]) -> Rollout:
        return Rollout(**{f.name: [getattr(self, f.name)[i] for i in rows] for f in fields(self)})

    @staticmethod
    def concat(parts: Sequence[Rollout]) -> Rollout:
        return Rollout(**{f.name: [x for part in parts for x in getattr(part, f.name)] for f in fields(Rollout)})


def group_requests(prompts: Sequence[Prompt]) -> list[Request]:
    """One request per run of equal consecutive prompts (a prompt's G samples, or a process's share of them)."""
    requests: list[Request] = []
    for prompt in prompts:
        if requests and requests[-1].prompt == prompt:
            requests[-1] = Request(prompt, requests[-1].num_samples + 1)
        else:
            requests.append(Request(prompt))
    return requests


def expand(requests: Sequence[Request]) -> list[Request]:
    """One entry per completion row: each request repeated `num_samples` times."""
    return [request for request in requests for _ in range(request.num_samples)]


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) with rows right-aligned, the layout decoder-only generation needs."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids, mask


def right_pad(rows: Sequence[Sequence[Any]], pad: Any, dtype: torch.dtype = torch.long) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = r if isinstance(r, torch.Tensor) else torch.tensor(r, dtype=dtype)
    return out
