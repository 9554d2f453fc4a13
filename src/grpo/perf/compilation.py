"""torch's speed switches that a config asks for: `torch.compile` of the training forward (`torch_compile`,
`torch_compile_backend`, `torch_compile_mode`) and TF32 matmuls (`tf32`).

What is compiled is the policy's decoder stack (`model.base_model`: embeddings, blocks, final norm), swapped in
around the training passes only (`CompiledForward`). Not the whole model: the training pass puts a fresh hook
on the output head at every call (it hands the tiled log-prob kernel the hidden states), and dynamo does not
guard on module hooks (`skip_nnmodule_hook_guards`), so a compiled whole model would go on running the first
pass's hook. Not generation: the engines' decode loops change the sequence length at every token. The stack is
compiled once per kind of pass (gradient or not, shared prompt or not) and shape (dynamo makes the lengths dynamic
after the first change), and backward is compiled with it.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any

import torch

from grpo.config import ResolvedConfig
from grpo.models.modeling import swapped_forwards, unwrap

logger = logging.getLogger("grpo")


class CompiledForward:
    """The policy's decoder stack compiled with torch.compile; `with compiled():` runs it inside the block."""

    def __init__(self, model: Any, backend: str, mode: str | None) -> None:
        stack = decoder_stack(model)
        self.backend, self.mode = backend, mode
        self.module = stack
        # compiled lazily, at the first pass: building this costs nothing
        self.forward = torch.compile(stack.forward, backend=backend, mode=mode)

    def __call__(self) -> contextlib.AbstractContextManager:
        return swapped_forwards([(self.module, self.forward)])


def compiled_forward(model: Any, args: ResolvedConfig, device: torch.device) -> CompiledForward | None:
    """The run's compiled stack when `args.torch_compile` is set (None otherwise); a backend or mode torch
    cannot use here is an error naming the field."""
    if not args.torch_compile:
        return None
    backend = args.torch_compile_backend or "inductor"  # transformers' default
    check_compile_settings(backend, args.torch_compile_mode, device)
    compiled = CompiledForward(model, backend, args.torch_compile_mode)
    logger.info("torch_compile: the training forward's decoder stack is compiled (backend %s).", backend)
    return compiled


def decoder_stack(model: Any) -> torch.nn.Module:
    """The transformers model's base model (the stack under the output head)."""
    inner = unwrap(model)
    stack = getattr(inner, "base_model", None)
    if not isinstance(stack, torch.nn.Module) or stack is inner:
        raise ValueError(
            f"GRPOConfig.torch_compile: grpo compiles the decoder stack under the output head (model.base_model), "
            f"and {type(inner).__name__} has none apart from itself. Set torch_compile=False for this model."
        )
    return stack


def check_compile_settings(backend: str, mode: str | None, device: torch.device) -> None:
    """Refuse, naming the field, what torch.compile would fail on later (at the first training pass)."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(
            f"GRPOConfig.torch_compile_backend={backend!r} is not a torch.compile backend; use one of "
            f"{', '.join(known)} (None: inductor)."
        )
    if mode is not None:
        from torch._inductor import list_mode_options

        if backend != "inductor":
            raise ValueError(
                f"GRPOConfig.torch_compile_mode={mode!r} is an inductor mode, and torch_compile_backend is "
                f"{backend!r}; set torch_compile_backend='inductor' (or None), or torch_compile_mode=None."
            )
        if mode not in list_mode_options():
            raise ValueError(
                f"GRPOConfig.torch_compile_mode={mode!r} is not a torch.compile mode; use one of "
                f"{', '.join(list_mode_options())}."
            )
    if backend == "inductor":
        _check_inductor_toolchain(device)


def _check_inductor_toolchain(device: torch.device) -> None:
    """inductor writes C++ (CPU) or Triton (GPU) kernels: it needs a C++ compiler or Triton here."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ValueError(
                "GRPOConfig.torch_compile: the inductor backend needs Triton on a GPU, which is not installed; "
                "pip install triton, or set torch_compile_backend='aot_eager' (no code generation)."
            )
        return
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as err:  # inductor's own error types differ between torch versions
        raise ValueError(
            "GRPOConfig.torch_compile: the inductor backend compiles C++ kernels on the CPU and found no C++ "
            f"compiler ({type(err).__name__}); install g++ (or set CXX), or set torch_compile_backend='aot_eager'."
        ) from None


def tf32_decision(
    tf32: bool | None, torch_compile: bool, fp16: bool, bf16: bool, device_type: str, capability: tuple[int, int]
) -> tuple[bool | None, str | None]:
    """(the value for torch's TF32 switches, or None to leave torch's default; a warning, or None), as the HF
    Trainer decides: tf32=None keeps torch's default, except that torch_compile turns TF32 on (unless fp16
    alone), where it applies. TF32 exists on NVIDIA GPUs of compute capability 8.0 (Ampere) or newer. Elsewhere
    tf32=True has no effect and is warned about (the HF Trainer refuses it; a warning lets a GPU script run on a
    CPU too); tf32=False holds there without doing anything: nothing computes in TF32."""
    ampere = device_type == "cuda" and tuple(capability) >= (8, 0)
    if ampere:
        if tf32 is None:
            return (True if torch_compile and (bf16 or not fp16) else None), None
        return tf32, None
    if tf32:
        where = "this run has no CUDA device" if device_type != "cuda" else f"this GPU's capability is {capability}"
        return None, (
            "GRPOConfig.tf32=True has no effect: TF32 is a matmul mode of NVIDIA Ampere or newer GPUs (compute "
            f"capability 8.0+), and {where}."
        )
    return None, None


def set_tf32(args: ResolvedConfig, device: torch.device) -> None:
    """Apply `tf32_decision` to torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    value, warning = tf32_decision(
        args.tf32, args.torch_compile, bool(args.fp16), bool(args.bf16), device.type, capability
    )
    if warning is not None:
        warnings.warn(warning, stacklevel=3)
    if value is not None:
        torch.backends.cuda.matmul.allow_tf32 = value
        torch.backends.cudnn.allow_tf32 = value
