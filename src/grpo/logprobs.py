"""Token log-probabilities and entropies from logits: pure functions of tensors.

The hot path of the training pass. Nothing here ever materialises log_softmax over the whole vocabulary for
more than one chunk of rows at a time, so memory stays O(chunk x V) on top of the logits themselves.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def logps_and_entropy(logits: torch.Tensor, ids: torch.Tensor, with_entropy: bool = True, entropy_grad: bool = False,
                      chunk_rows: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token log-probs (float32, with gradient) and entropies from one log_softmax per chunk of rows.

    One pass over the vocabulary serves both, and only one chunk's float32 (rows, T, V) log_softmax is alive at
    a time outside autograd. Entropies carry a gradient only with `entropy_grad`."""
    logps, entropies = [], []
    for chunk, chunk_ids in zip(logits.split(chunk_rows), ids.split(chunk_rows)):
        logp = torch.log_softmax(_at_least_float32(chunk), dim=-1)
        logps.append(logp.gather(-1, chunk_ids.unsqueeze(-1)).squeeze(-1))
        if with_entropy:
            source = logp if entropy_grad else logp.detach()
            entropies.append(-(source.exp() * source).sum(-1))
    return torch.cat(logps), (torch.cat(entropies) if with_entropy else None)


def _chunk_logps(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
                 temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.nn.functional.linear(hidden, weight, bias) / temperature
    logp = torch.log_softmax(_at_least_float32(logits), dim=-1)
    picked = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else picked.new_zeros(picked.shape)
    return picked, entropy


def chunked_logps_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              ids: torch.Tensor, temperature: float, with_entropy: bool = True,
                              entropy_grad: bool = False, chunk_tokens: int = 256
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token log-probs from hidden states without ever holding the (B, T, V) logits.

    The output projection, log_softmax and gather run `chunk_tokens` tokens at a time; under autograd each chunk
    is checkpointed, so backward recomputes that chunk's logits instead of keeping them: peak extra memory is
    one chunk's (chunk_tokens, V) float32 logits, whatever B and T are. Same values as projecting everything
    and calling `logps_and_entropy`."""
    shape = ids.shape
    flat_hidden, flat_ids = hidden.reshape(-1, hidden.shape[-1]), ids.reshape(-1)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logps, entropies = [], []
    for start in range(0, flat_ids.shape[0], chunk_tokens):
        h, i = flat_hidden[start:start + chunk_tokens], flat_ids[start:start + chunk_tokens]
        if grad:
            lp, ent = torch.utils.checkpoint.checkpoint(_chunk_logps, h, weight, bias, i, temperature, with_entropy,
                                                        use_reentrant=False)
        else:
            lp, ent = _chunk_logps(h, weight, bias, i, temperature, with_entropy)
        logps.append(lp)
        entropies.append(ent if entropy_grad else ent.detach())
    entropy = torch.cat(entropies).reshape(shape) if with_entropy else None
    return torch.cat(logps).reshape(shape), entropy
