"""Calling reward functions: sync ones in turn, `async def` ones concurrently on a private event loop, and
every returned value checked, so a broken reward stops training with a message naming the function, the
sample and the value instead of training silently on garbage."""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch


class RewardFunctionError(ValueError):
    """A reward function raised, or returned something that is not one number (or None) per completion."""


def reward_name(func: Any) -> str:
    """Metric name of a reward function: its __name__ (partials unwrapped), else its class name."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", None) or type(func).__name__


def check_reward_funcs(reward_funcs: Any, reward_weights: Sequence[float] | None) -> list[Callable]:
    """Normalize `reward_funcs` to a list of callables and check `reward_weights` against it."""
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise ValueError("reward_funcs is empty: pass at least one reward function.")
    for func in funcs:
        if isinstance(func, str) or isinstance(func, torch.nn.Module):
            raise ValueError(f"reward_funcs entry {func!r} is a reward model: reward models are not available yet in "
                             "grpo. Wrap the scoring in a Python function returning list[float] instead.")
        if not callable(func):
            raise ValueError(f"reward_funcs entry {func!r} is not callable: pass functions that take the completions "
                             "as keyword arguments and return one float (or None) per completion.")
    if reward_weights is not None and len(reward_weights) != len(funcs):
        raise ValueError(f"reward_weights has {len(reward_weights)} entries but there are {len(funcs)} reward "
                         "functions: give exactly one weight per function.")
    return funcs


class _BackgroundLoop:
    """One event loop on a daemon thread, shared by every async reward call. Running the coroutines there (not
    with asyncio.run) works even when the caller already runs a loop (notebooks)."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def run(cls, coroutines: list) -> list:
        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                threading.Thread(target=cls._loop.run_forever, daemon=True, name="grpo-rewards").start()

        async def gather():
            return await asyncio.gather(*coroutines, return_exceptions=True)

        return asyncio.run_coroutine_threadsafe(gather(), cls._loop).result()


def _is_async(func: Any) -> bool:
    target = func.func if isinstance(func, functools.partial) else func
    # a callable object with `async def __call__`
    method = next((k.__dict__["__call__"] for k in type(target).__mro__ if "__call__" in k.__dict__), None)
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(method)


def _check_values(name: str, values: Any, n: int) -> list[float]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise RewardFunctionError(f"Reward function '{name}' returned {type(values).__name__} {values!r:.80}; it must "
                                  f"return a list with one float (or None) per completion ({n} here).")
    values = list(values)
    if len(values) != n:
        raise RewardFunctionError(f"Reward function '{name}' returned {len(values)} values for {n} completions; it "
                                  "must return exactly one float (or None) per completion.")
    out = []
    for i, value in enumerate(values):
        if value is None:
            out.append(math.nan)
            continue
        if not isinstance(value, numbers.Real):
            raise RewardFunctionError(f"Reward function '{name}' returned {value!r:.80} ({type(value).__name__}) for "
                                      f"sample {i}; rewards must be numbers, or None when the function does not "
                                      "apply to a sample.")
        if not math.isfinite(value):
            raise RewardFunctionError(f"Reward function '{name}' returned {value} for sample {i}; rewards must be "
                                      "finite. Return None to say the function does not apply to a sample.")
        out.append(float(value))
    return out


def score(funcs: Sequence[Callable], names: Sequence[str], kwargs: dict[str, Any], n: int) -> torch.Tensor:
    """(n, K) float32 rewards, NaN where a function returned None. Raises RewardFunctionError on bad output."""
    results: dict[int, Any] = {}
    pending = []
    for k, func in enumerate(funcs):
        if _is_async(func):
            pending.append(k)
            continue
        try:
            results[k] = func(**kwargs)
        except Exception as err:
            raise RewardFunctionError(f"Reward function '{names[k]}' raised {type(err).__name__}: {err}") from err
    if pending:
        outputs = _BackgroundLoop.run([funcs[k](**kwargs) for k in pending])
        for k, output in zip(pending, outputs):
            if isinstance(output, BaseException):
                raise RewardFunctionError(f"Reward function '{names[k]}' raised {type(output).__name__}: "
                                          f"{output}") from output
            results[k] = output
    columns = [_check_values(names[k], results[k], n) for k in range(len(funcs))]
    return torch.tensor(columns, dtype=torch.float32).T.reshape(n, len(funcs))
