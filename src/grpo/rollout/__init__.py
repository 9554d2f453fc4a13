"""Generation engines behind one interface (`grpo.rollout.base`): requests in (`grpo.base.records`), completions with
their sampling log-probs out.

- `plain.TransformersEngine`: `model.generate`, every `generation_kwargs` key transformers knows;
- `fast.FastEngine`: our own decode loop (prefix sharing, shrinking batch), on `lean_decoder.LeanDecoder` for
  Llama-family models;
- `vllm.VLLMEngine`: a vLLM engine in the training process (`use_vllm=True`, colocate mode), sampling
  from a copy of the policy's weights that `sync_weights` refreshes;
- `remote.ServerEngine`: generation on vLLM servers (`vllm_mode="server"`: vLLM's own server, as `grpo vllm-serve`
  starts it), weights pushed through vLLM's weight-transfer engine.

`build_engine` picks one from the config and logs why; it hands the engine the config's `SamplingSettings` (and a
vLLM engine its `VLLMSettings` or `ServerSettings`), built once, never the config itself.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from grpo.algo.sampling import SamplingSettings
from grpo.base.records import Prompt, Request, Rollout
from grpo.config import ResolvedConfig
from grpo.models.vision import suppressed_tokens
from grpo.rollout import fast, remote
from grpo.rollout.base import Engine
from grpo.rollout.plain import TransformersEngine
from grpo.rollout.vllm import VLLMEngine, VLLMSettings

logger = logging.getLogger("grpo")
__all__ = ["Engine", "Prompt", "Request", "Rollout", "build_engine"]  # the records re-exported from grpo.base


def build_engine(
    model: Any, tokenizer: Any, args: ResolvedConfig, stop_ids: list[int], accelerator: Any, pixels: Any = None
) -> Engine:
    """vLLM with use_vllm; else the fast engine where it applies, else the plain `model.generate` engine; the log
    says which and why. `pixels` (`grpo.models.vision.Pixels`): a vision-language model's image inputs."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)
    sampling = SamplingSettings.of(args)
    if args.use_vllm and args.vllm_mode == "server":
        servers = remote.ServerSettings.of(args)
        logger.info("Generating on the vLLM server(s) at %s.", ", ".join(servers.urls))
        if args.vllm_tensor_parallel_size > 1:  # as in 1.16, a colocate setting
            logger.warning(
                "vllm_tensor_parallel_size=%d is for colocate mode; a server's shards are set where it starts: grpo "
                "vllm-serve --tensor-parallel-size.",
                args.vllm_tensor_parallel_size,
            )
        suppressed = suppressed_tokens(model) if pixels is not None else []
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        vocab_size = int(getattr(config, "vocab_size", None) or len(tokenizer))
        return remote.ServerEngine(
            tokenizer, sampling, servers, stop_ids, accelerator, model.config, vocab_size, suppressed
        )
    if args.use_vllm:
        return _vllm_engine(model, tokenizer, args, sampling, stop_ids, accelerator, dtype, pixels)
    reason = fast.unsupported_reason(model, sampling)
    if reason is None and pixels is not None:
        reason = "the model takes image inputs (the fast engine decodes text only)"
    if reason is None:
        engine: Engine = fast.FastEngine(
            model, tokenizer, sampling, stop_ids, autocast=accelerator.autocast, compute_dtype=dtype
        )
        logger.info("Generating with grpo's fast engine.")
        return engine
    logger.info("Generating with the plain transformers engine: %s.", reason)
    return TransformersEngine(model, tokenizer, sampling, stop_ids, autocast=accelerator.autocast, pixels=pixels)


def _vllm_engine(
    model: Any,
    tokenizer: Any,
    args: ResolvedConfig,
    sampling: SamplingSettings,
    stop_ids: list[int],
    accelerator: Any,
    dtype: torch.dtype | None,
    pixels: Any = None,
) -> Engine:
    device = accelerator.device.type
    settings = VLLMSettings.of(args)
    if settings.enable_sleep_mode and device == "cpu":
        raise ValueError(
            "vllm_enable_sleep_mode=True frees GPU memory between generations; vLLM's CPU build has no sleep mode. "
            "Set vllm_enable_sleep_mode=False on a CPU."
        )
    parallel, processes = settings.tensor_parallel_size, accelerator.num_processes
    if processes % parallel:
        raise ValueError(
            f"vllm_tensor_parallel_size={parallel} splits one vLLM engine across that many training processes, but "
            f"this run has {processes}: the number of processes must be a multiple of it. Launch with torchrun "
            f"--nproc_per_node {parallel} (or a multiple), or set vllm_tensor_parallel_size=1 for one engine per "
            "process."
        )
    return VLLMEngine(
        model,
        tokenizer,
        sampling,
        settings,
        stop_ids,
        dtype=dtype or next(model.parameters()).dtype,
        device=device,
        process_index=accelerator.process_index,
        rows=args.generation_batch_size // accelerator.num_processes,
        pixels=pixels,
    )
