"""Weights into a vLLM engine in place: `load_weights` for the colocate engine (`grpo.rollout.vllm`), and `repack`,
what a reload leaves stale on vLLM's CPU backend, which packs some matrices for its kernels once (a tied output head;
a mixture of experts' experts), for it and for a server's `gloo` weight-transfer engine (`grpo.serve.vllm_plugin`).
Every function here that takes a `worker` runs on each of the engine's workers (`collective_rpc`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch


def load_weights(llm: Any, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, tied: bool) -> None:
    """Load (name, tensor) pairs in checkpoint names into a vLLM engine, in place: vLLM's reload reprocesses them
    as its loader does, what vLLM's CPU backend packs once is packed again (`repack`), and the prefix and encoder
    caches (computed with the old weights) are dropped. `VLLMEngine.sync_weights`'s."""
    # in the engine's dtype: vLLM would cast each tensor itself, with a warning per parameter
    cast = ((name, tensor.to(dtype)) for name, tensor in weights)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": cast})
    llm.collective_rpc(_repack_worker, args=(tied,))
    llm.reset_prefix_cache()
    # a vision-language model's image embeddings were computed with the old vision tower: not to be reused
    reset_encoder = getattr(getattr(llm, "llm_engine", None), "reset_encoder_cache", None)
    if reset_encoder is not None:
        reset_encoder()


def quiet_expected_reload_warnings() -> None:
    """Drop vLLM's per-reload warnings about layers a checkpoint never has weights for (`_expected_reload_gaps`)."""
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_expected_reload_gaps)


def _expected_reload_gaps(record: logging.LogRecord) -> bool:
    """Drop vLLM's per-sync warnings about layers a checkpoint never has weights for: the rotary embedding (its
    tables are computed) and a tied output head (its weight is the embedding's; `_repack_tied_head` repacks it)."""
    layer = record.args[0] if isinstance(record.args, tuple) and record.args else None
    return not (record.getMessage().endswith("Failed to load weights") and layer in _NO_CHECKPOINT_WEIGHTS)


_NO_CHECKPOINT_WEIGHTS = ("RotaryEmbedding", "ParallelLMHead")


def _repack_worker(worker: Any, tied: bool) -> None:
    """Run on each vLLM worker after a reload: `repack` its model."""
    repack(worker.model_runner.get_model(), tied)


def repack(model: Any, tied: bool) -> None:
    """After new weights were loaded into a vLLM model (`tied`: its output head shares the input embedding), pack
    again what vLLM's CPU backend packs once (`_repack_tied_head`, `_repack_cpu_experts`); nothing on GPUs."""
    if tied:
        _repack_tied_head(model)
    _repack_cpu_experts(model)


def _repack_tied_head(model: Any) -> None:
    """After a reload, for a model whose output head shares the input embedding: vLLM's CPU backend packs the
    head's matrix for its GEMM when weights are processed, and a reload reprocesses only the layers that received
    weights, i.e. the embedding, so the head would keep sampling from the old (at start: dummy) weights.
    Reprocessing the head packs it from the embedding's new values (on GPUs, where nothing is packed, it does
    nothing)."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)


def _repack_cpu_experts(model: Any) -> None:
    """After a reload, for a mixture-of-experts model on vLLM's CPU backend: its experts' kernel packs their
    matrices into its grouped-GEMM layout once, when the engine first processes its weights, and a reload (a weight
    update) writes the new matrices into the parameters without packing them again, so the engine would keep
    sampling from the old (at start: dummy) experts: log-probs up to 0.69 off on a tiny Qwen3-MoE. The kernel
    packs them again from the new values. GPU kernels read the parameters themselves: nothing to do there."""
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__name__.startswith("CPU"):
            experts.process_weights_after_loading(module)
