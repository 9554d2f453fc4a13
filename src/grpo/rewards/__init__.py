"""Rewards: the built-in reward functions (`from grpo.rewards import accuracy_reward`), calling and checking
reward functions (`calling`), and sequence-classification reward models (`models`)."""

from grpo.rewards.builtin import (
    accuracy_reward,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
)

__all__ = [
    "accuracy_reward",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "reasoning_accuracy_reward",
    "think_format_reward",
]
