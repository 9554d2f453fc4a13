"""Token log-probabilities and entropies from logits: pure functions of tensors.

The hot path of the training pass. Nothing here ever materialises log_softmax over the whole vocabulary for
more than one chunk of rows at a time, so memory stays O(chunk x V) on top of the logits themselves.
"""

from __future__ import annotations

import torch


def selective_log_softmax(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[..., ids] without keeping a second (.., V) tensor alive.

    float32/float64: logit - logsumexp (exact, no (.., V) output). Lower precision: log_softmax row by row,
    because logsumexp in bfloat16 loses too much.
    """
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, -1, ids.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    rows = [torch.log_softmax(row, dim=-1).gather(-1, row_ids.unsqueeze(-1)).squeeze(-1)
            for row, row_ids in zip(logits, ids)]
    return torch.stack(rows)


def entropy_from_logits(logits: torch.Tensor, chunk_rows: int = 1) -> torch.Tensor:
    """H = -sum_v p_v log p_v (nats) per position, in float32, computed a chunk of rows at a time."""
    out = []
    for chunk in logits.split(chunk_rows, dim=0):
        logp = torch.log_softmax(chunk.float(), dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out)
