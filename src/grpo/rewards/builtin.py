"""Built-in reward functions (shared spec §9). Each takes the trainer's keyword arguments and returns one
float, or None for "does not apply", per completion.

- `accuracy_reward`: math-verify equivalence of the completion's answer and the `solution` column (§9.1).
- `reasoning_accuracy_reward`: the same, on the text after the reasoning delimiter; 0.0 without one (§9.2).
- `think_format_reward`: 1.0 when the completion opens with a single `<think>...</think>` block (§9.3).
- `get_soft_overlong_punishment`: DAPO's soft length penalty on `completion_ids` (§9.4).
- `get_cosine_scaled_reward`: correctness scaled by length on a cosine schedule (§9.5).
- `get_repetition_penalty_reward`: penalty for repeated token n-grams in `completion_ids` (§9.6).

The factories return instances of small module-level classes rather than closures, so the rewards stay picklable;
each instance's `__name__` is the name the trainer logs it under."""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable
from typing import Any

_INCOMPLETE = "[incomplete reasoning]"
_THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def _content(completion: Any) -> str:
    """The text of a completion: a string, or the content of a one-message conversational completion."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def _math_rewards(
    contents: list[str | None], solution: list[str], log_extra: Callable[[str, list], None] | None, caller: str
) -> list[float | None]:
    """Scores each content against its solution with math-verify (the body of §9.1). A content of None stands for
    a completion whose reasoning never ended: it scores 0.0 and its gold is not parsed."""
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError as err:
        raise ImportError(f"{caller} needs math-verify: pip install 'math-verify[antlr4_13_2]'") from err

    # math-verify times out with signal.alarm, which exists only on the main thread.
    on_main = threading.current_thread() is threading.main_thread()
    parse_timeout, verify_timeout = (10, 5) if on_main else (None, None)
    if not on_main:
        logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
        logging.getLogger("math_verify.grader").setLevel(logging.ERROR)
    answer_config = [
        LatexExtractionConfig(
            normalization_config=NormalizationConfig(units=True),
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
    ]
    rewards: list[float | None] = []
    golds: list[str] = []
    answers: list[str] = []
    for content, sol in zip(contents, solution, strict=True):
        if content is None:
            rewards.append(0.0)
            golds.append(_INCOMPLETE)
            answers.append(_INCOMPLETE)
            continue
        gold = parse(sol, parsing_timeout=parse_timeout)
        if len(gold) == 0:
            rewards.append(None)
            golds.append("[unparseable]")
            answers.append("[skipped]")
            continue
        answer = parse(
            content, extraction_config=answer_config, extraction_mode="first_match", parsing_timeout=parse_timeout
        )
        rewards.append(float(verify(gold, answer, timeout_seconds=verify_timeout)))
        golds.append(str(gold))
        answers.append(str(answer) if answer else "[unparseable]")
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", golds)
        log_extra("answer_parsed", answers)
    return rewards


def accuracy_reward(
    completions: list, solution: list[str], log_extra: Callable[[str, list], None] | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when math-verify finds the completion's answer equal to `solution`, else 0.0; None when the reference
    solution itself cannot be parsed (the sample is skipped rather than punished).

    The answer must be written in LaTeX (\\boxed{...} is tried first); the reference is parsed with
    math-verify's defaults (LaTeX or plain expression)."""
    return _math_rewards([_content(c) for c in completions], solution, log_extra, "accuracy_reward")


def _final_answer(content: str, delimiters: list[str]) -> str | None:
    """The text after the last occurrence of the first delimiter (in list order) that occurs in `content`; None
    when none occurs."""
    for delimiter in delimiters:
        if delimiter in content:
            return content.split(delimiter)[-1]
    return None


def reasoning_accuracy_reward(
    completions: list,
    solution: list[str],
    reasoning_delimiters: list[str] | None = None,
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """`accuracy_reward` on the final answer only: the text after the reasoning delimiter (default "</think>").
    A completion without any delimiter did not finish reasoning and gets 0.0 (not None); an unparseable
    solution still gives None."""
    delimiters = ["</think>"] if reasoning_delimiters is None else reasoning_delimiters
    contents = [_final_answer(_content(c), delimiters) for c in completions]
    return _math_rewards(contents, solution, log_extra, "reasoning_accuracy_reward")


def think_format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion starts with `<think>`, closes it with `</think>` and contains no second `<think>`
    anywhere (an empty think block is fine), else 0.0."""
    return [1.0 if _THINK_FORMAT.match(_content(c)) else 0.0 for c in completions]


class _SoftOverlongPunishment:
    """DAPO eq. 13 on the token length: 0 up to L-C, then linearly down to -1 at L, and -1 beyond L."""

    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int) -> None:
        self.max_completion_len = max_completion_len
        self.soft_punish_cache = soft_punish_cache

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        free = self.max_completion_len - self.soft_punish_cache
        rewards = []
        for ids in completion_ids:
            n = len(ids)
            if n <= free:
                rewards.append(0.0)
            elif n <= self.max_completion_len:
                rewards.append((free - n) / self.soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> _SoftOverlongPunishment:
    """The soft overlong punishment of DAPO (eq. 13) with L = `max_completion_len` and C = `soft_punish_cache`,
    as a picklable reward named "soft_overlong_punishment_reward". It never rewards short completions."""
    return _SoftOverlongPunishment(max_completion_len, soft_punish_cache)


class _CosineScaledReward:
    """Correctness (from `accuracy_reward`) scaled by the token length on a cosine schedule."""

    __name__ = "cosine_scaled_reward"

    def __init__(
        self,
        max_len: int,
        min_value_wrong: float,
        max_value_wrong: float,
        min_value_correct: float,
        max_value_correct: float,
    ) -> None:
        self.max_len = max_len
        self.min_value_wrong = min_value_wrong
        self.max_value_wrong = max_value_wrong
        self.min_value_correct = min_value_correct
        self.max_value_correct = max_value_correct

    def __call__(
        self, completions: list, solution: list[str], completion_ids: list[list[int]], **kwargs: Any
    ) -> list[float | None]:
        rewards: list[float | None] = []
        for correct, ids in zip(accuracy_reward(completions, solution), completion_ids, strict=True):
            if correct is None:
                rewards.append(None)
                continue
            # Clamped, since cos rises again past pi and would reward completions longer than max_len.
            progress = min(len(ids) / self.max_len, 1.0)
            if correct:
                low, high = self.min_value_correct, self.max_value_correct
            else:  # swapped, so that a short wrong completion is punished hardest
                low, high = self.max_value_wrong, self.min_value_wrong
            rewards.append(float(low + 0.5 * (high - low) * (1.0 + math.cos(progress * math.pi))))
        return rewards


def get_cosine_scaled_reward(
    max_len: int,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> _CosineScaledReward:
    """A picklable reward named "cosine_scaled_reward": with p = min(len(completion_ids)/max_len, 1), a correct
    completion gets vmin + (vmax - vmin)(1 + cos(pi p))/2 with (vmin, vmax) = (min_value_correct,
    max_value_correct), a wrong one the same with (max_value_wrong, min_value_wrong), and None when the solution
    cannot be parsed. It needs the `solution` column."""
    return _CosineScaledReward(max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct)


class _RepetitionPenalty:
    """(1 - unique/total n-grams of the completion's token ids) * max_penalty; 0.0 below n tokens."""

    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int, max_penalty: float) -> None:
        self.ngram_size = ngram_size
        self.max_penalty = max_penalty

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        n = self.ngram_size
        rewards = []
        for ids in completion_ids:
            if len(ids) < n:
                rewards.append(0.0)
                continue
            ngrams = list(zip(*(ids[i:] for i in range(n))))
            repeated = 1 - len(set(ngrams)) / len(ngrams)
            rewards.append(repeated * self.max_penalty if repeated else 0.0)  # no -0.0 for repeat-free text
        return rewards


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> _RepetitionPenalty:
    """A picklable reward named "repetition_penalty_reward" that penalizes repeated token n-grams of size
    `ngram_size`, down to `max_penalty` (which must not be positive) for a fully repetitive completion."""
    if max_penalty > 0:
        raise ValueError(f"max_penalty must be zero or negative (it is the most negative reward), got {max_penalty}.")
    return _RepetitionPenalty(ngram_size, max_penalty)


__all__ = [
    "accuracy_reward",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "reasoning_accuracy_reward",
    "think_format_reward",
]
