"""grpo: Group Relative Policy Optimization for language models, TRL-compatible.

from grpo import GRPOConfig, GRPOTrainer
from grpo import AsyncGRPOConfig, AsyncGRPOTrainer   # generation overlapped with training

The names are imported on first use: vLLM's processes import `grpo.serve` (grpo's weight-transfer plugin) without
the trainer and what it pulls in.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from grpo.async_trainer import AsyncGRPOTrainer
    from grpo.config import GRPOConfig
    from grpo.config.async_config import AsyncGRPOConfig
    from grpo.trainer import GRPOTrainer

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "GRPOConfig", "GRPOTrainer"]
__version__ = "0.1.0"
_HOMES = {
    "AsyncGRPOTrainer": "grpo.async_trainer",
    "GRPOConfig": "grpo.config",
    "AsyncGRPOConfig": "grpo.config.async_config",
    "GRPOTrainer": "grpo.trainer",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
