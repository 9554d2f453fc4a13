"""Mixed-precision linear layers for the training pass that keep less for backward than autocast does.

Under autocast a linear layer casts its float32 weight and input to bfloat16, multiplies, and keeps both
bfloat16 copies for backward: a second copy of every weight (the autocast cache, alive from forward to the end
of backward) and one bfloat16 copy of the input per layer, even when q/k/v (or gate/up) read the same input.
`lean_linears` swaps each plain `nn.Linear` for the same arithmetic that keeps, instead:
- the float32 weight itself (the parameter, already in memory), cast again in backward;
- one bfloat16 copy per distinct input tensor, shared by the layers that read it.
The numbers are autocast's: the same casts, the same bfloat16 matrix products, gradients returned in float32 and
summed in float32 where an input feeds several layers (tested bit-identical to autocast). One difference, for
the better: a weight used by two forward calls in one pass (the prefix-shared training pass) gets its two
gradients summed in float32, where autocast sums them in bfloat16 at its single cached cast.
Cost: each weight is cast once more per forward, in backward (a few tens of milliseconds per step for a 135M
model). Saved: a bfloat16 copy of every weight and of the repeated inputs. It trades some speed (a Python-level
Function per layer call, the extra casts) for memory (`bench/RESULTS.md`), so it is opt-in:
`GRPOConfig(lean_linears=True)`.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from grpo.distributed.sharding import is_sharded
from grpo.distributed.zero import is_partitioned
from grpo.models.modeling import recomputes_activations, swapped_forwards


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, low_x, weight, bias, dtype):
        ctx.save_for_backward(low_x, weight, bias)
        ctx.x_dtype, ctx.dtype = x.dtype, dtype
        return F.linear(low_x, weight.to(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad):
        low_x, weight, bias = ctx.saved_tensors
        grad = grad.to(ctx.dtype)
        want_x, _, want_w, want_b, _ = ctx.needs_input_grad
        grad_x = grad.matmul(weight.to(ctx.dtype)).to(ctx.x_dtype) if want_x else None
        flat = grad.reshape(-1, grad.shape[-1])
        grad_w = low_x.reshape(-1, low_x.shape[-1]).t().mm(flat).t().to(weight.dtype) if want_w else None
        grad_b = flat.sum(0).to(bias.dtype) if want_b and bias is not None else None
        return grad_x, None, grad_w, grad_b, None


@contextlib.contextmanager
def lean_linears(model: torch.nn.Module, dtype: torch.dtype):
    """Within the context, every plain `nn.Linear` of the model computes as under `dtype` autocast but keeps
    only the float32 weight and one low-precision copy per input for backward. Use around the forward only:
    backward needs nothing from the context."""
    # id(input) -> (weak reference to the input, its low-precision copy): the input itself is not kept alive
    casts: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def low(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == dtype:
            return x.detach()
        hit = casts.get(id(x))
        if hit is None or hit[0]() is not x:
            hit = casts[id(x)] = (weakref.ref(x), x.detach().to(dtype))
        return hit[1]

    def make_forward(module: torch.nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if x.numel() == 0:  # the skipped output head: nothing to compute, no weight to cast
                return x.new_empty(*x.shape[:-1], module.out_features, dtype=dtype)
            with torch.autocast(x.device.type, enabled=False):
                return _Linear.apply(x, low(x), module.weight, module.bias, dtype)

        return forward

    patched = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dtype != dtype]
    try:
        with swapped_forwards([(module, make_forward(module)) for module in patched]):
            yield
    finally:
        casts.clear()


def unsupported_reason(model: Any, autocast_dtype: torch.dtype | None) -> str | None:
    """Why `lean_linears` cannot be used for this model's training pass (None when it can)."""
    if autocast_dtype is None:
        return "no autocast"
    if recomputes_activations(model):
        return "gradient checkpointing recomputes the forward outside the context"
    if is_sharded(model):
        return "sharded parameters are gathered and freed per layer by FSDP"
    if is_partitioned(model):
        return "partitioned parameters are gathered and freed per layer by DeepSpeed ZeRO-3"
    return None
