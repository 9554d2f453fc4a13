"""grpo: Group Relative Policy Optimization for language models, TRL-compatible.

from grpo import GRPOConfig, GRPOTrainer
"""

from grpo.config import GRPOConfig
from grpo.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
__version__ = "0.1.0"
