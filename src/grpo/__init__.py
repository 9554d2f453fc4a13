"""grpo: Group Relative Policy Optimization for language models, TRL-compatible.

from grpo import GRPOConfig, GRPOTrainer
from grpo import AsyncGRPOConfig, AsyncGRPOTrainer   # generation overlapped with training
"""

from grpo.async_trainer import AsyncGRPOTrainer
from grpo.config import GRPOConfig
from grpo.config.async_config import AsyncGRPOConfig
from grpo.trainer import GRPOTrainer

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "GRPOConfig", "GRPOTrainer"]
__version__ = "0.1.0"
