"""The training batch: a generation's rollouts as padded tensors (shared spec §2.1).

Prompt ids are left-padded, completion ids right-padded, concatenated in the training pass; with
`pad_to_multiple_of` both widths are multiples of it (the training pass keeps that when it trims padding).
`num_items_in_batch` is the number of trained tokens in the whole generation batch (every process's rows): the
token-sum losses divide by it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from grpo.base.records import Prompt, Rollout, Turns, left_pad, right_pad

# completion-position tensors: trimmed together when padding columns are dropped
_COMPLETION_FIELDS = ("completion_ids", "completion_attention", "mask", "sampling_logps", "old_logps", "ref_logps")


@dataclass
class TrainBatch:
    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P)
    completion_ids: torch.Tensor  # (B, C) right-padded
    completion_attention: torch.Tensor  # (B, C) 1 on completion tokens the model attends to
    mask: torch.Tensor  # (B, C) float, 1 on tokens the loss trains
    advantages: torch.Tensor  # (B,)
    sampling_logps: torch.Tensor  # (B, C) the sampler's log-probs (0 on padding)
    group: torch.Tensor  # (B,) prompt id: rows with the same id share the same prompt tokens
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    num_items_in_batch: float = 0.0  # trained tokens in the whole generation batch, all processes
    pad_to_multiple_of: int | None = None  # prompt and completion widths are multiples of it
    vision: list[Prompt | None] | None = None  # image prompts: each row's Prompt (None: text-only row)
    # multi-turn rollouts sampled from rendered histories (`Rollout.turns`): each row's turns, None for a row that is
    # one sequence (the prompt, then the completion); None when no row has turns
    turns: list[Turns | None] | None = None

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def padded_width(self, width: int) -> int:
        """`width` completion positions rounded up to the batch's pad_to_multiple_of (never past its width)."""
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        return min(width, self.completion_ids.shape[1])

    def _map(self, fn: Any, names: tuple[str, ...] | None = None) -> TrainBatch:
        """A copy with fn applied to the tensor fields (those in `names` only, when given)."""
        values = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            chosen = names is None or f.name in names
            values[f.name] = fn(value) if chosen and isinstance(value, torch.Tensor) else value
        return TrainBatch(**values)

    def select(self, rows: torch.Tensor | slice) -> TrainBatch:
        batch = self._map(lambda t: t[rows])
        index = range(len(self))[rows] if isinstance(rows, slice) else rows.tolist()
        if self.vision is not None:
            batch.vision = [self.vision[i] for i in index]
        if self.turns is not None:
            batch.turns = [self.turns[i] for i in index]
        return batch

    def trim(self, width: int) -> TrainBatch:
        """Keep the first `width` completion positions (dropping padding columns)."""
        return self._map(lambda t: t[:, :width], _COMPLETION_FIELDS)

    def to(self, device: torch.device) -> TrainBatch:
        return self._map(lambda t: t.to(device))

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only (a checkpoint is read with torch.load(weights_only=True)): image prompts
        as their text, token ids and pixels (`_prompt_state`)."""
        state = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.vision is not None:
            state["vision"] = [None if p is None else _prompt_state(p) for p in self.vision]
        return state

    @staticmethod
    def from_state_dict(state: dict[str, Any]) -> TrainBatch:
        state = dict(state)
        if state.get("vision") is not None:
            state["vision"] = [None if p is None else _prompt_from_state(p) for p in state["vision"]]
        return TrainBatch(**state)


def _to_multiple(x: torch.Tensor, multiple: int | None, value: Any, left: bool = False) -> torch.Tensor:
    """x (B, T) padded with `value` on one side to a width that is a multiple of `multiple` (None: as it is)."""
    extra = -x.shape[1] % multiple if multiple else 0
    return torch.nn.functional.pad(x, (extra, 0) if left else (0, extra), value=value) if extra else x


def collate(
    rollout: Rollout,
    advantages: torch.Tensor,
    pad_id: int,
    mask_truncated: bool,
    group: torch.Tensor | None = None,
    pad_to_multiple_of: int | None = None,
) -> TrainBatch:
    n = pad_to_multiple_of
    prompt_ids, prompt_mask = left_pad(rollout.prompt_ids, pad_id)
    prompt_ids, prompt_mask = _to_multiple(prompt_ids, n, pad_id, left=True), _to_multiple(prompt_mask, n, 0, True)
    completion_ids = _to_multiple(right_pad(rollout.completion_ids, pad_id), n, pad_id)
    attention = _to_multiple(right_pad([[1] * len(c) for c in rollout.completion_ids], 0), n, 0)
    loss_mask = _to_multiple(right_pad(rollout.loss_mask, 0), n, 0)
    if mask_truncated:
        # truncated rows leave the loss, the token count and attention (shared spec §10.2)
        attention = attention * (~torch.tensor(rollout.truncated, dtype=torch.bool)).long().unsqueeze(1)
    mask = (attention * loss_mask).float()

    def logps(rows: list) -> torch.Tensor:
        return _to_multiple(right_pad(rows, 0.0, dtype=torch.float32), n, 0.0)

    behaviour = rollout.behaviour_logps  # an asynchronous producer's behaviour policy, where it computed one
    old = logps(behaviour) if behaviour and all(row is not None for row in behaviour) else None
    return TrainBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_attention=attention,
        mask=mask,
        advantages=advantages.float(),
        sampling_logps=logps(rollout.sampling_logps),
        group=group if group is not None else torch.arange(len(rollout.prompt_ids)),
        old_logps=old,
        num_items_in_batch=float(mask.sum()),
        pad_to_multiple_of=n,
        vision=list(rollout.vision) if any(p is not None for p in rollout.vision) else None,
        turns=list(rollout.turns) if any(t is not None for t in rollout.turns) else None,
    )


def _prompt_state(prompt: Any) -> dict[str, Any]:
    """An image prompt as tensors and plain values (for a checkpoint read with weights_only=True): what the forward
    passes need, its text, token ids and images (uint8 HxWx3), exactly."""
    images = [torch.from_numpy(np.array(image.convert("RGB"), dtype=np.uint8)) for image in prompt.images or ()]
    return {"ids": list(prompt.ids), "text": prompt.text, "images": images}


def _prompt_from_state(state: dict[str, Any]) -> Prompt:
    images = tuple(Image.fromarray(t.numpy()) for t in state["images"])
    return Prompt(ids=tuple(state["ids"]), images=images or None, text=state["text"])
