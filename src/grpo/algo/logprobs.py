"""Token log-probabilities and entropies: pure functions of tensors, the hot path of the training pass.

`chunked_logps_and_entropy` goes from the hidden states straight to log-probs, a chunk of rows at a time, so the
(B, T, V) logits never exist (memory O(chunk x V)); `logps_and_entropy` is the plain path from given logits, for
output heads the chunked one cannot take over.
"""

from __future__ import annotations

import torch


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def logps_and_entropy(
    logits: torch.Tensor, ids: torch.Tensor, with_entropy: bool = True, entropy_grad: bool = False, chunk_rows: int = 1
) -> tuple[torch.Tensor, torch.Tensor | None]:
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


class _HeadLogps(torch.autograd.Function):
    """Output projection + log-softmax + gather (+ entropy), tile by tile, with a hand-written backward.

    Tiles are (rows, vocabulary block). Forward runs an online log-sum-exp over the vocabulary blocks and keeps
    only each row's log-sum-exp and entropy; backward recomputes one tile's logits at a time and turns them
    straight into the gradients of the hidden states and of that block of the head's weight (and bias). No
    (N, V) tensor exists in either direction; cutting the vocabulary (not the rows) keeps every matrix product
    long in all three dimensions, and each weight block's gradient is written once per row chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, temperature, with_entropy, entropy_grad, dtype, chunk_rows, block):
        h, b = hidden.to(dtype), (None if bias is None else bias.to(dtype))
        wide = torch.promote_types(dtype, torch.float32)
        n = h.shape[0]
        lse, picked, entropy = (hidden.new_empty(n, dtype=wide) for _ in range(3))
        for rows in _spans(n, chunk_rows):
            r = rows.stop - rows.start
            high = hidden.new_full((r,), -float("inf"), dtype=wide)
            total, weighted, chosen = (hidden.new_zeros(r, dtype=wide) for _ in range(3))
            for cols in _spans(weight.shape[0], block):
                z = _scaled_logits(h[rows], weight[cols].to(dtype), b, cols, wide, temperature)
                inside, at = _in_block(ids[rows], cols)
                chosen = torch.where(inside, z.gather(1, at[:, None])[:, 0], chosen)
                new_high = torch.maximum(high, z.amax(-1))
                rescale = (high - new_high).exp()
                shifted = z.sub_(new_high[:, None])
                e = shifted.exp()
                e_sum = e.sum(-1)
                total = total * rescale + e_sum
                if with_entropy:  # sum over the vocabulary of exp(z - high) * z, kept in step with `total`
                    weighted = weighted * rescale + e.mul_(shifted).sum(-1) + new_high * e_sum
                high = new_high
            lse[rows] = high + total.log()
            picked[rows] = chosen - lse[rows]
            entropy[rows] = lse[rows] - weighted / total  # H = lse - sum(p * z)
        ctx.save_for_backward(h, weight, bias, ids, lse, entropy)
        ctx.settings = temperature, entropy_grad, chunk_rows, block, hidden.dtype
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_picked, grad_entropy):
        h, weight, bias, ids, lse, entropy = ctx.saved_tensors
        temperature, entropy_grad, chunk_rows, block, hidden_dtype = ctx.settings
        dtype, wide = h.dtype, lse.dtype
        b = None if bias is None else bias.to(dtype)
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(h, dtype=wide) if want_h else None
        grad_w = torch.zeros_like(weight, dtype=wide) if want_w else None
        grad_b = torch.zeros_like(bias, dtype=wide) if bias is not None and want_b else None
        # the chain rule through z = logits / temperature, folded into the per-row factors
        g_picked = grad_picked / temperature
        g_entropy = grad_entropy / temperature if entropy_grad and grad_entropy is not None else None
        for rows in _spans(h.shape[0], chunk_rows):
            for cols in _spans(weight.shape[0], block):
                w = weight[cols].to(dtype)  # one block of the weight in the compute dtype at a time
                logp = _scaled_logits(h[rows], w, b, cols, wide, temperature).sub_(lse[rows, None])
                p = logp.exp()
                # d logp_i / dz_j = [j = i] - p_j ;  dH / dz_j = -p_j (logp_j + H)
                if g_entropy is not None:
                    g = logp.add_(entropy[rows, None]).mul_(g_entropy[rows, None]).add_(g_picked[rows, None])
                    g = g.mul_(p).neg_()
                else:
                    g = p.mul_(-g_picked[rows, None])
                inside, at = _in_block(ids[rows], cols)
                g.scatter_add_(1, at[:, None], torch.where(inside, g_picked[rows], 0.0)[:, None])
                g = g.to(dtype)
                if grad_h is not None:
                    grad_h[rows] += g @ w
                if grad_w is not None:
                    grad_w[cols] += g.T @ h[rows]
                if grad_b is not None:
                    grad_b[cols] += g.sum(0)
        grads = [
            None if x is None else x.to(like)
            for x, like in (
                (grad_h, hidden_dtype),
                (grad_w, weight.dtype),
                (grad_b, None if bias is None else bias.dtype),
            )
        ]
        return (*grads, None, None, None, None, None, None, None)


def _scaled_logits(
    h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cols: slice, wide: torch.dtype, temperature: float
) -> torch.Tensor:
    """One tile's logits / temperature in the wide dtype (a fresh tensor the caller may overwrite); `w` is the
    weight's block `cols`."""
    z = torch.nn.functional.linear(h, w, None if b is None else b[cols]).to(wide)
    return z if temperature == 1.0 else z.div_(temperature)


def _in_block(ids: torch.Tensor, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """Which ids fall in the vocabulary block, and their column inside it (clamped for the others)."""
    inside = (ids >= cols.start) & (ids < cols.stop)
    return inside, (ids - cols.start).clamp_(0, cols.stop - cols.start - 1)


def _spans(n: int, size: int) -> list[slice]:
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


# Rows per chunk, and float32 bytes of one tile's logits: big enough for fast matrix products, small next to the
# model. The vocabulary block is whatever fits the tile (at least 256 columns). On a CPU, tiles of a few MiB keep
# their temporaries in cache (faster and smaller than 32 MiB: `bench/RESULTS.md`).
CHUNK_ROWS = 4096
TILE_BYTES = 8 * 2**20
# On a GPU a tile's operators are kernel launches: at 8 MiB a 152k vocabulary takes ~300 blocks of ~45 launches each
# per 4,096 tokens, far more time than their arithmetic. A GPU's tile is large (a few blocks per vocabulary), and at
# most 1/64 of the device's memory (its temporaries hold a few times the tile).
GPU_TILE_BYTES = 512 * 2**20


def tile_bytes(device: torch.device) -> int:
    """The float32 bytes of one tile's logits on `device`: `TILE_BYTES` on a CPU (cache-sized), up to
    `GPU_TILE_BYTES` on a GPU."""
    if device.type != "cuda":
        return TILE_BYTES
    return min(GPU_TILE_BYTES, torch.cuda.get_device_properties(device).total_memory // 64)


def chunked_logps_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    temperature: float,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    chunk_rows: int = CHUNK_ROWS,
    block: int | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token log-probs (and entropies) of `ids` from the hidden states the output head would project, without
    ever holding the (B, T, V) logits: tiles of `chunk_rows` tokens by `block` vocabulary entries (default: a
    float32 tile of `tile_bytes(device)`; each block of the weight is cast to the compute dtype when its tile
    runs).

    Same values as projecting everything and calling `logps_and_entropy`, with one difference in bfloat16: the
    logits are divided by the temperature after the cast to float32 (as the sampler does), not before. Under
    autocast the projection runs in the autocast dtype, like the model's own head would; `dtype`, when given,
    is the projection's dtype whatever autocast says (float32 for `cast_lm_head_to_fp32`)."""
    shape = ids.shape
    device = hidden.device.type
    if dtype is None:
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows = min(chunk_rows, max(flat.shape[0], 1))
    block = block or max(256, tile_bytes(hidden.device) // (4 * rows))
    with torch.autocast(device, enabled=False):
        lp, ent = _HeadLogps.apply(
            flat, weight, bias, ids.reshape(-1), temperature, with_entropy, entropy_grad, dtype, rows, block
        )
    return lp.reshape(shape), (ent.reshape(shape) if with_entropy else None)
