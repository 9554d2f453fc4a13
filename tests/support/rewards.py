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


def stepped(bases):
    """A reward whose logged mean at step k (1-based) is bases[k-1] + 0.15: completion i scores
    base + 0.1 * (i % 4), and (0 + 0.1 + 0.2 + 0.3) / 4 = 0.15."""

    def stepped(completions, trainer_state, **kwargs):
        base = bases[trainer_state.global_step]
        return [base + 0.1 * (i % 4) for i in range(len(completions))]

    return stepped
