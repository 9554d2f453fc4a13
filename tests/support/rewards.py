"""Reward functions the tests share, each defined once."""

from __future__ import annotations


def text_of(completion):
    return completion if isinstance(completion, str) else completion[0]["content"]


def length_reward(completions, **kwargs):
    """A reward with spread within groups: longer completions score more."""
    return [len(text_of(c)) / 8.0 for c in completions]


def token_count_reward(completion_ids, **kwargs):
    """A reward with spread within groups: a completion's length in tokens."""
    return [float(len(c)) for c in completion_ids]
