"""Built-in reward functions (shared spec §9). Each takes the trainer's keyword arguments and returns one
float, or None for "does not apply", per completion."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any


def _content(completion: Any) -> str:
    """The text of a completion: a string, or the content of a one-message conversational completion."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def accuracy_reward(completions: list, solution: list[str], log_extra: Callable[[str, list], None] | None = None,
                    **kwargs: Any) -> list[float | None]:
    """1.0 when math-verify finds the completion's answer equal to `solution`, else 0.0; None when the reference
    solution itself cannot be parsed (the sample is skipped rather than punished).

    The answer must be written in LaTeX (\\boxed{...} is tried first); the reference is parsed with
    math-verify's defaults (LaTeX or plain expression)."""
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError as err:
        raise ImportError("accuracy_reward needs math-verify: pip install 'math-verify[antlr4_13_2]'") from err

    # math-verify times out with signal.alarm, which exists only on the main thread.
    on_main = threading.current_thread() is threading.main_thread()
    parse_timeout, verify_timeout = (10, 5) if on_main else (None, None)
    if not on_main:
        logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
        logging.getLogger("math_verify.grader").setLevel(logging.ERROR)
    answer_config = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                           boxed_match_priority=0, try_extract_without_anchor=False)]
    rewards, golds, answers = [], [], []
    for completion, sol in zip(completions, solution, strict=True):
        gold = parse(sol, parsing_timeout=parse_timeout)
        if len(gold) == 0:
            rewards.append(None)
            golds.append("[unparseable]")
            answers.append("[skipped]")
            continue
        answer = parse(_content(completion), extraction_config=answer_config, extraction_mode="first_match",
                       parsing_timeout=parse_timeout)
        rewards.append(float(verify(gold, answer, timeout_seconds=verify_timeout)))
        golds.append(str(gold))
        answers.append(str(answer) if answer else "[unparseable]")
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", golds)
        log_extra("answer_parsed", answers)
    return rewards


__all__ = ["accuracy_reward"]
