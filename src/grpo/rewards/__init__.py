"""Rewards: the built-in reward functions (`from grpo.rewards import accuracy_reward`), calling and checking
reward functions (`calling`), and sequence-classification reward models (`models`)."""

from grpo.rewards import builtin
from grpo.rewards.builtin import *  # noqa: F403 (the built-ins are this package's public names)

__all__ = builtin.__all__
