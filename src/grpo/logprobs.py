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


def logps_and_entropy(logits: torch.Tensor, ids: torch.Tensor, with_entropy: bool = True, entropy_grad: bool = False,
                      chunk_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token log-probs (float32, with gradient) and entropies from one log_softmax per chunk of rows.

    One pass over the vocabulary serves both, and only one chunk's float32 (rows, T, V) log_softmax is alive at
    a time outside autograd. Entropies carry a gradient only with `entropy_grad`."""
    logps, entropies = [], []
    for chunk, chunk_ids in zip(logits.split(chunk_rows), ids.split(chunk_rows)):
        logp = torch.log_softmax(chunk.float(), dim=-1)
        logps.append(logp.gather(-1, chunk_ids.unsqueeze(-1)).squeeze(-1))
        if with_entropy:
            source = logp if entropy_grad else logp.detach()
            entropies.append(-(source.exp() * source).sum(-1))
    return torch.cat(logps), (torch.cat(entropies) if with_entropy else None)
