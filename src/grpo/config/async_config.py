"""`AsyncGRPOConfig`: TRL 1.16's asynchronous GRPO config (`trl.experimental.async_grpo`) as a `GRPOConfig` with
`async_generation=True`, so every GRPO option applies (loss types, beta, LoRA, tools, dynamic sampling, evaluation,
every engine) and TRL's async field names are accepted.

TRL's defaults where its async config sets its own: learning_rate 1e-6, logging_steps 1, lr_scheduler_type
"constant", max_staleness 4, ignore_data_skip True. `max_staleness` means a fixed lag here, not a drop threshold
(`grpo.rounds.asynchronous`);
`weight_sync_steps` and `heartbeat_stale_after_s` are GRPOConfig fields with TRL's meaning.
`dtype` loads the model in that dtype (TRL's async default: float32). The fields of TRL's own pipeline that grpo's
producer has no counterpart for (ASYNC_ONLY) keep TRL's defaults and refuse any other value, all named at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from grpo.config import GRPOConfig, _reject_unknown_kwargs, compat
from grpo.config.fields import help_field as _help

# TRL 1.16 AsyncGRPOConfig fields grpo has no counterpart for: (default, why)
ASYNC_ONLY = {
    "max_inflight_tasks": (-1, "the producer generates one round at a time; max_staleness bounds how far ahead"),
    "queue_maxsize": (1024, "rounds wait in no queue: at most max_staleness are produced ahead"),
    "token_budget": (None, "micro-batches have per_device_train_batch_size rows (no token-budget packing)"),
    "fork_threshold_tokens": (1024, "the tool loop keeps each turn's sampled tokens: nothing is re-tokenized"),
    "request_timeout": (600, "server requests use vllm_server_timeout"),
    "weight_sync_timeout": (1800, "weights reach the engine in-process, or a server's within vllm_server_timeout"),
}


@dataclass
class AsyncGRPOConfig(GRPOConfig):
    """GRPOConfig with async_generation on and TRL 1.16's AsyncGRPOConfig fields and defaults (module docstring)."""

    async_generation: bool = _help("Generate while training (always on for AsyncGRPOTrainer).", True)
    max_staleness: int = _help(
        "Round k samples the policy the learner had at round k - max_staleness (a fixed lag: TRL drops samples "
        "older than this instead).",
        4,
    )
    learning_rate: float = _help("Initial learning rate (TRL's async default).", 1e-6)
    logging_steps: float = _help("Log every N optimizer steps (TRL's async default: every step).", 1)
    lr_scheduler_type: str = _help("transformers scheduler name (TRL's async default: constant).", "constant")
    ignore_data_skip: bool = _help("TRL's async default; grpo's prompt order needs no data skipping.", True)
    dtype: Optional[str] = _help(
        "Load the model in this dtype when it is given by name: auto, bfloat16, float16 or float32 (TRL's async "
        "default: float32); model_init_kwargs['dtype'] wins.",
        "float32",
    )
    max_inflight_tasks: int = _help("TRL's concurrent generation tasks; grpo: only the default.", -1)
    queue_maxsize: int = _help("TRL's sample queue size; grpo: only the default.", 1024)
    token_budget: Optional[int] = _help("TRL's token-budget micro-batching; grpo: only the default.", None)
    fork_threshold_tokens: int = _help("TRL's multi-turn re-tokenization threshold; grpo: only the default.", 1024)
    request_timeout: int = _help("TRL's per-request timeout; grpo: only the default.", 600)
    weight_sync_timeout: int = _help("TRL's weight-transfer timeout; grpo: only the default.", 1800)

    def __post_init__(self) -> None:
        changed = [
            f"{name}={getattr(self, name)!r} ({why})"
            for name, (default, why) in ASYNC_ONLY.items()
            if getattr(self, name) != default
        ]
        if changed:
            raise ValueError(
                "AsyncGRPOConfig: grpo's asynchronous producer has no counterpart for "
                + "; ".join(changed)
                + ". Leave these at TRL's defaults."
            )
        if self.dtype not in (None, "auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"AsyncGRPOConfig: dtype is {self.dtype!r}; use auto, bfloat16, float16 or float32.")
        if self.dtype is not None:
            init_kwargs = self.model_init_kwargs
            if isinstance(init_kwargs, str):  # JSON from a command line: GRPOConfig.__post_init__ parses it later
                init_kwargs = compat.json_dict("model_init_kwargs", init_kwargs)
            self.model_init_kwargs = {"dtype": self.dtype, **(init_kwargs or {})}
        self.async_generation = True
        super().__post_init__()


# wraps the dataclass-made __init__ (its signature unchanged), which mypy does not let a method be assigned
AsyncGRPOConfig.__init__ = _reject_unknown_kwargs(  # type: ignore[method-assign]
    AsyncGRPOConfig.__init__, AsyncGRPOConfig
)
