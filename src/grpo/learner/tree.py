"""Tree packing (`packing="tree"`): the training pass over a micro-batch laid out as one token tree per prompt group.

A group's row holds its prompt once (its real tokens, no left padding), then each completion's real tokens one
after another (no right padding). Attention follows an ancestor mask: a completion token sees the prompt and the
earlier tokens of its own completion, never another completion's; positions follow each token's own context (a
completion's first token is at the prompt's length, as in the padded pass). So every completion token gets the
outputs it gets in the padded pass, while the pass computes each prompt token once and no padding inside a group:
only the rows of different groups are padded to the longest tree (those positions attend to themselves alone and no
real token attends to them).

The mask is handed to the model as a prepared 4D mask (transformers uses one as it is, for its eager and SDPA
attention); `unsupported_reason` names the models and settings where that would not give the padded pass's numbers,
which keep the padded layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from grpo.learner.batch import TrainBatch
from grpo.models.modeling import unwrap
from grpo.rollout.fast import keeps_recurrent_state

# the attention implementations that read a prepared 4D mask as it is given (a boolean one for SDPA, an additive one
# for eager attention)
_MASKED = ("sdpa", "eager")


@dataclass(frozen=True)
class Tree:
    """A micro-batch as trees: `input_ids`, `positions` and `real` (R, T) for R groups, `mask` (R, 1, T, T) True where
    a query may attend a key, and for each completion position of the batch (B, C) the tree row and column whose
    output predicts it (`row`, `column`)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    real: torch.Tensor
    mask: torch.Tensor
    row: torch.Tensor
    column: torch.Tensor

    @property
    def positions_computed(self) -> int:
        """Positions the pass computes (rows times their padded width)."""
        return self.input_ids.numel()


# A tree's most tokens: the mask and the attention grow with the square of a row's length, so a group whose prompt
# and completions add up to more is cut into several trees, each with the prompt once (the same numbers; a tree of
# one completion may be longer).
MAX_WIDTH = 2048


def layout(batch: TrainBatch, max_width: int | None = None) -> Tree:
    """`batch`'s rows as one tree per group (`batch.group`), or several where a group's tokens pass `max_width`;
    completions are their attended tokens (`completion_attention`, a prefix of each row)."""
    device = batch.prompt_ids.device
    max_width = max_width or MAX_WIDTH
    # laid out on the host (a few small tensors), moved to the batch's device at the end
    prompt_ids, prompt_mask = batch.prompt_ids.cpu(), batch.prompt_mask.cpu()
    completion_ids = batch.completion_ids.cpu()
    lengths = batch.completion_attention.sum(-1).tolist()
    prompts = prompt_mask.sum(-1).tolist()
    groups: dict[int, list[list[int]]] = {}
    for i, group in enumerate(batch.group.tolist()):
        trees_of_group = groups.setdefault(group, [[]])
        width = prompts[i] + sum(lengths[j] for j in trees_of_group[-1]) + lengths[i]
        if trees_of_group[-1] and width > max_width:
            trees_of_group.append([])
        trees_of_group[-1].append(i)
    c = batch.completion_ids.shape[1]
    row = torch.zeros(len(batch), c, dtype=torch.long)
    column = torch.zeros(len(batch), c, dtype=torch.long)
    trees = []
    for r, members in enumerate(m for parts in groups.values() for m in parts):
        first = members[0]  # every row of a group holds the same prompt tokens
        prompt = prompt_ids[first][prompt_mask[first].bool()]
        p = len(prompt)
        ids, places, segments = [prompt], [torch.arange(p)], [torch.zeros(p, dtype=torch.long)]
        start = p
        for k, i in enumerate(members):
            n = lengths[i]
            ids.append(completion_ids[i, :n])
            places.append(torch.arange(p, p + n))
            segments.append(torch.full((n,), k + 1, dtype=torch.long))
            row[i] = r
            # token 0 is predicted by the prompt's last token, token t by its own token t - 1
            if n:
                column[i, :n] = torch.cat([torch.tensor([p - 1]), torch.arange(start, start + n - 1)])
            start += n
        trees.append((torch.cat(ids), torch.cat(places), torch.cat(segments)))
    width = max(len(t[0]) for t in trees)
    # any id will do at the padding between trees: no real token attends to it and its outputs are never read
    input_ids = torch.full((len(trees), width), int(prompt_ids[0, 0]), dtype=prompt_ids.dtype)
    positions = torch.zeros(len(trees), width, dtype=torch.long)
    segment = torch.full((len(trees), width), -1, dtype=torch.long)  # -1: padding
    for r, (ids_, pos, seg) in enumerate(trees):
        input_ids[r, : len(ids_)], positions[r, : len(pos)], segment[r, : len(seg)] = ids_, pos, seg
    index = torch.arange(width)
    causal = index.view(1, width, 1) >= index.view(1, 1, width)  # query i may see key j <= i ...
    query, key = segment.unsqueeze(2), segment.unsqueeze(1)
    ancestor = (key == 0) | (key == query)  # ... of the prompt, or of its own completion
    mask = causal & ancestor & (key >= 0)
    mask = mask | (torch.eye(width, dtype=torch.bool) & (query == -1))  # padding sees itself: no empty softmax
    return Tree(
        input_ids=input_ids.to(device),
        positions=positions.to(device),
        real=(segment >= 0).long().to(device),
        mask=mask.unsqueeze(1).to(device),
        row=row.to(device),
        column=column.to(device),
    )


def attention_mask(model: Any, tree: Tree) -> torch.Tensor:
    """The tree's mask as the model's attention takes a prepared one: boolean for SDPA, additive for eager."""
    if unwrap(model).config._attn_implementation == "sdpa":
        return tree.mask
    dtype = next(unwrap(model).parameters()).dtype
    return torch.zeros(tree.mask.shape, dtype=dtype, device=tree.mask.device).masked_fill(
        ~tree.mask, torch.finfo(dtype).min
    )


def fits_window(model: Any, batch: TrainBatch) -> bool:
    """Whether every row's whole sequence fits the model's sliding attention window (always, without one): a
    prepared mask replaces the window's own, which only matters past the window."""
    window = getattr(unwrap(model).config, "sliding_window", None)
    if not window:
        return True
    longest = int((batch.prompt_mask.sum(-1) + batch.completion_attention.sum(-1)).max())
    return longest <= window


def unsupported_reason(model: Any) -> str | None:
    """Why this model's training pass cannot take a tree (None when it can)."""
    inner = unwrap(model)
    config = inner.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in _MASKED:
        return f"its attention ({implementation}) does not take a prepared 4D mask; use 'sdpa' or 'eager'"
    if getattr(config, "is_encoder_decoder", False):
        return "the model is an encoder-decoder"
    if keeps_recurrent_state(inner):
        return "the model has recurrent layers, whose state follows the token order, not the tree"
    return None
