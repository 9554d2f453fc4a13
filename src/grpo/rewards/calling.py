"""Calling reward functions: sync ones in turn, `async def` ones concurrently on a private event loop, and
every returned value checked, so a broken reward stops training with a message naming the function, the
sample and the value instead of training silently on garbage.

`RewardFunctions` is what the trainer holds: the functions (reward models loaded as functions), their names and
weights, and one call that scores a rollout with every dataset column passed as a keyword."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import inspect
import logging
import math
import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from grpo.base import sigterm
from grpo.base.background import BackgroundLoop, DaemonCall
from grpo.base.records import Rollout
from grpo.config import ResolvedConfig
from grpo.data.prompts import RESERVED_COLUMNS
from grpo.rewards.models import load_reward_model

FLOAT32_MAX = 3.4028234663852886e38


class RewardFunctionError(ValueError):
    """A reward function raised, or returned something that is not one number (or None) per completion."""


def reward_name(func: Any) -> str:
    """Metric name of a reward function: its __name__ (partials unwrapped), else its class name."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", None) or type(func).__name__


def check_reward_funcs(
    reward_funcs: Any,
    reward_weights: Sequence[float] | None,
    processing_classes: Any = None,
    load_model: Callable[[Any, Any], Callable] | None = None,
) -> list[Callable]:
    """Normalize `reward_funcs` to a list of callables and check `reward_weights` against it. Reward models
    (a model id/path or an `nn.Module`) become callables through `load_model(entry, tokenizer)`, with their
    tokenizer from `reward_processing_classes` (one object, or one entry per function; None: the model's own)."""
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise ValueError("reward_funcs is empty: pass at least one reward function.")
    if processing_classes is None:
        tokenizers = [None] * len(funcs)
    else:  # one object stands for a list of one, as in TRL 1.16 (two reward models rarely share a vocabulary)
        tokenizers = list(processing_classes) if isinstance(processing_classes, (list, tuple)) else [processing_classes]
        if len(tokenizers) != len(funcs):
            raise ValueError(
                f"The number of reward processing classes ({len(tokenizers)}) must match the number of reward "
                f"functions ({len(funcs)}): give reward_processing_classes one entry per function (None for plain "
                "functions and for reward models that use their own tokenizer)."
            )
    out = []
    for func, tokenizer in zip(funcs, tokenizers):
        if isinstance(func, (str, torch.nn.Module)):
            if load_model is None:
                raise ValueError(f"reward_funcs entry {func!r:.80} is a reward model, which needs a trainer to load.")
            func = load_model(func, tokenizer)
        elif not callable(func):
            raise ValueError(
                f"reward_funcs entry {func!r} is not callable: pass functions that take the completions "
                "as keyword arguments and return one float (or None) per completion, or a reward "
                "model (id, path or sequence-classification module)."
            )
        out.append(func)
    if reward_weights is not None and len(reward_weights) != len(out):
        raise ValueError(
            f"reward_weights has {len(reward_weights)} entries but there are {len(out)} reward "
            "functions: give exactly one weight per function."
        )
    return out


def _is_async(func: Any) -> bool:
    target = func.func if isinstance(func, functools.partial) else func
    # a callable object with `async def __call__`
    method = next((k.__dict__["__call__"] for k in type(target).__mro__ if "__call__" in k.__dict__), None)
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(method)


def _check_values(name: str, values: Any, n: int) -> list[float]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise RewardFunctionError(
            f"Reward function '{name}' returned {type(values).__name__} {values!r:.80}; it must "
            f"return a list with one float (or None) per completion ({n} here)."
        )
    values = list(values)
    if len(values) != n:
        raise RewardFunctionError(
            f"Reward function '{name}' returned {len(values)} values for {n} completions; it "
            "must return exactly one float (or None) per completion."
        )
    out = []
    for i, value in enumerate(values):
        if value is None:
            out.append(math.nan)
            continue
        if not isinstance(value, numbers.Real):
            raise RewardFunctionError(
                f"Reward function '{name}' returned {value!r:.80} ({type(value).__name__}) for "
                f"sample {i}; rewards must be numbers, or None when the function does not "
                "apply to a sample."
            )
        if not math.isfinite(value) or abs(float(value)) > FLOAT32_MAX:
            raise RewardFunctionError(
                f"Reward function '{name}' returned {value} for sample {i}; rewards must be finite in float32 "
                "(|x| <= 3.4e38), the precision they are normalized in. Return None to say the function does "
                "not apply to a sample."
            )
        out.append(float(value))
    return out


def score(
    funcs: Sequence[Callable],
    names: Sequence[str],
    kwargs: dict[str, Any] | Callable[[], dict[str, Any]],
    n: int,
    timeout: float | None = None,
) -> torch.Tensor:
    """(n, K) float32 rewards, NaN where a function returned None. Raises RewardFunctionError on bad output, on
    a raise, and on a call that takes longer than `timeout` seconds (None or 0: no limit).

    `kwargs` is the keywords, or a function making a fresh copy of them for each reward function (so that what one
    function does to its arguments reaches neither the others nor the trainer). The `async def` functions start
    first, on the background loop, each under the time limit; the sync ones run in turn, each on a daemon worker
    thread while this thread waits (so a hung one is reported, and SIGTERM is seen: `grpo.base.sigterm`). An error
    is reported at once, without waiting for the other functions."""
    fresh = kwargs if callable(kwargs) else (lambda: kwargs)
    is_async = [_is_async(func) for func in funcs]
    async_ks = [k for k in range(len(funcs)) if is_async[k]]
    coroutines = [_timed(names[k], funcs[k], fresh(), timeout) for k in async_ks]
    pending = BackgroundLoop.submit(coroutines) if async_ks else None
    results: dict[int, Any] = {}
    try:
        for k, func in enumerate(funcs):
            if not is_async[k]:
                results[k] = _call_in_thread(names[k], func, fresh(), timeout)
        outputs = _wait_for_async(pending, [names[k] for k in async_ks], timeout) if pending else []
    except BaseException:
        if pending is not None:
            pending.cancel()  # never wait for the async ones after an error (a hung one would hang the run)
        raise
    for k, output in zip(async_ks, outputs):
        if isinstance(output, RewardFunctionError):
            raise output
        if isinstance(output, BaseException):
            raise RewardFunctionError(
                f"Reward function '{names[k]}' raised {type(output).__name__}: {output}"
            ) from output
        results[k] = output
    columns = [_check_values(names[k], results[k], n) for k in range(len(funcs))]
    rewards = torch.tensor(columns, dtype=torch.float32).T.reshape(n, len(funcs))
    _warn_unscorable(rewards, fresh())
    return rewards


def _call(name: str, func: Callable, kwargs: dict[str, Any]) -> Any:
    """func(**kwargs) (for an async function: its coroutine), a raise turned into a RewardFunctionError."""
    try:
        return func(**kwargs)
    except Exception as err:
        raise RewardFunctionError(f"Reward function '{name}' raised {type(err).__name__}: {err}") from err


def _too_slow(names: Sequence[str], timeout: float) -> RewardFunctionError:
    which = ", ".join(f"'{name}'" for name in names)
    return RewardFunctionError(
        f"Reward function {which} did not return within {timeout:g} s (GRPOConfig.reward_timeout). Make it "
        "faster, or raise reward_timeout (None or 0: no limit); checkpoints on disk are untouched."
    )


async def _timed(name: str, func: Callable, kwargs: dict[str, Any], timeout: float | None) -> Any:
    """The async function's call under the time limit, on the background loop."""
    try:
        return await asyncio.wait_for(_call(name, func, kwargs), timeout or None)
    except asyncio.TimeoutError:
        assert timeout is not None  # wait_for times out only under a limit
        raise _too_slow([name], timeout) from None


def _wait(done: Callable[[float], bool], names: Sequence[str], timeout: float | None) -> None:
    """Wait until `done(poll_seconds)` says so, checking for SIGTERM in between; past `timeout` (+1 s of grace
    for the async functions' own limits to fire) the named functions are reported as hung."""
    deadline = time.monotonic() + timeout + 1.0 if timeout else None
    while not done(0.05):
        sigterm.check(progress=False)  # waiting on a reward function is no progress (a hang is a stall)
        if deadline is not None and time.monotonic() > deadline:
            assert timeout is not None  # the deadline is set from it
            raise _too_slow(names, timeout)
    sigterm.check()  # it returned: progress


def _call_in_thread(name: str, func: Callable, kwargs: dict[str, Any], timeout: float | None) -> Any:
    """func(**kwargs) on a daemon thread (a hung call cannot keep the process alive), waited for here."""
    call = DaemonCall(lambda: _call(name, func, kwargs), f"grpo-reward-{name}")
    _wait(call.join, [name], timeout)
    return call.outcome()


def _wait_for_async(pending: concurrent.futures.Future, names: Sequence[str], timeout: float | None) -> list:
    def finished(poll: float) -> bool:
        try:
            pending.result(timeout=poll)
        except concurrent.futures.TimeoutError:
            return False
        return True

    _wait(finished, names, timeout)
    return pending.result()


def _warn_unscorable(rewards: torch.Tensor, kwargs: dict[str, Any]) -> None:
    rows = torch.isnan(rewards).all(dim=1).nonzero().squeeze(-1).tolist()
    if not rows:
        return
    shown = []
    for i in rows[:3]:
        prompt = kwargs["prompts"][i]
        completion = kwargs["completions"][i]
        prompt = prompt[-1]["content"] if isinstance(prompt, list) else prompt
        completion = completion[0]["content"] if isinstance(completion, list) else completion
        shown.append(f"sample {i}: prompt {prompt!r:.120}, completion {completion!r:.120}")
    more = f" (and {len(rows) - 3} more)" if len(rows) > 3 else ""
    # logged, not warnings.warn: each step's samples are news (a warning would show once), and TRL logs it
    logging.getLogger("grpo").warning(
        "All reward functions returned None for the following kwargs: %s%s. These %d sample(s) get advantage 0: "
        "make sure at least one reward function applies to every sample.",
        "; ".join(shown),
        more,
        len(rows),
    )


# what the trainer logs itself (best checkpoint, early stopping and the diagnostics read some): a reward function's
# log_metric may not write these names
TRAINER_METRICS = frozenset(
    "loss grad_norm learning_rate reward reward_std frac_reward_zero_std entropy kl num_tokens step_time epoch step "
    "policy_loss aux_loss entropy_coef train_loss num_input_tokens_seen".split()
)
TRAINER_PREFIXES = ("rewards/", "completions/", "clip_ratio/", "sampling/", "timing/", "tools/", "eval_", "train_")


def _own_names_only(log_metric: Callable[[str, float], None]) -> Callable[[str, float], None]:
    """log_metric refusing the trainer's own metric names: `log_metric("reward", x)` would overwrite the reward that
    best-checkpoint selection and early stopping read."""

    def log(name: str, value: float) -> None:
        if not isinstance(name, str) or name in TRAINER_METRICS or name.startswith(TRAINER_PREFIXES):
            raise ValueError(
                f"log_metric({name!r}, ...): the trainer logs {name!r} itself (or the name is not a string); log "
                f"your metric under a name of its own, e.g. 'custom/{name}'."
            )
        log_metric(name, value)

    return log


# remove_unused_columns=True: the dataset columns reward functions still get besides the prompt (TRL 1.16's
# GRPOTrainer keeps "prompt", "image" and "images")
KEPT_COLUMNS = ("image", "images")


def copy_state(trainer_state: Any) -> Any:
    """A deep copy of a TrainerState whose log_history rows (numbers only) are copied as new dicts, not deep-copied
    (the history grows with the run). The trainer's state is only read."""
    shallow = copy.copy(trainer_state)
    shallow.log_history = []  # the copy's: the history is copied row by row below
    copied = copy.deepcopy(shallow)
    copied.log_history = [dict(row) for row in trainer_state.log_history]
    return copied


class RewardFunctions:
    """The run's reward functions, their metric names and weights; calling it scores one rollout. `keep_columns`:
    the only dataset columns (besides the prompt) the functions receive; None: every column."""

    def __init__(
        self,
        funcs: list[Callable],
        weights: Sequence[float] | None,
        timeout: float | None = None,
        keep_columns: Sequence[str] | None = None,
    ) -> None:
        self.funcs = funcs
        self.names = [reward_name(f) for f in funcs]
        self.weights = torch.tensor(weights or [1.0] * len(funcs))
        self.timeout = timeout
        self.keep_columns = keep_columns

    @classmethod
    def build(
        cls,
        reward_funcs: Any,
        args: ResolvedConfig,
        processing_classes: Any,
        device: torch.device,
        extra: Sequence[Callable] = (),
    ) -> RewardFunctions:
        """From GRPOTrainer's arguments; reward models (ids, paths, modules) are loaded now, on `device`. `extra`:
        functions that come after them with weight 1 (environments' get_reward); with those, reward_funcs may be
        None."""

        def load(entry: Any, tokenizer: Any) -> Callable:
            return load_reward_model(
                entry, tokenizer, args.model_init_kwargs, args.trust_remote_code, args.chat_template_kwargs, device
            )

        if extra and reward_funcs in (None, []):
            funcs, weights = [], list(args.reward_weights or [])
            if weights:
                raise ValueError(
                    "reward_weights is set but reward_funcs is empty: give one weight per reward function."
                )
        elif reward_funcs is None:
            raise ValueError(
                "No reward source provided: pass reward_funcs, or an environment_factory whose environments define "
                "get_reward."
            )
        else:
            funcs = check_reward_funcs(reward_funcs, args.reward_weights, processing_classes, load)
            weights = list(args.reward_weights or [1.0] * len(funcs))
        keep = KEPT_COLUMNS if args.remove_unused_columns else None
        return cls([*funcs, *extra], [*weights, *[1.0] * len(extra)], args.reward_timeout, keep)

    def __call__(
        self,
        examples: list[dict],
        rollout: Rollout,
        trainer_state: Any,
        log_metric: Callable[[str, float], None],
        log_extra: Callable[[str, list], None],
        prompts: list | None = None,
        live: dict[str, list] | None = None,
    ) -> torch.Tensor:
        """(rows, functions) rewards of the rollout's completions; every dataset column but the prompt (and
        "completion", "completion_ids"; with `keep_columns`, only those) reaches the functions as a keyword, one
        value per completion. Each function gets its own copy of everything (the trainer state too): what it does
        to its arguments changes nothing that is trained, nor what the other functions see. `prompts`: the prompts
        as generated from (None: the rows'); `live`: keyword columns passed as they are, not copied (environment
        instances, rollout_func's extra keys)."""
        columns: dict[str, list] = {}
        removed: set[str] = set()
        for example in examples:
            for key, value in example.items():
                if key in ("prompt", "completion", "completion_ids"):
                    continue
                if self.keep_columns is not None and key not in self.keep_columns:
                    removed.add(key)
                    continue
                columns.setdefault(key, []).append(value)
        self._check_removed_columns(removed)
        _check_shadowing(columns, live or {})
        shared = dict(
            columns,
            prompts=prompts if prompts is not None else [e["prompt"] for e in examples],
            completions=rollout.completions,
            completion_ids=rollout.completion_ids,
        )
        log_metric = _own_names_only(log_metric)

        def fresh() -> dict[str, Any]:
            state = copy_state(trainer_state)
            return dict(
                copy.deepcopy(shared), **(live or {}), trainer_state=state, log_metric=log_metric, log_extra=log_extra
            )

        try:
            return score(self.funcs, self.names, fresh, len(examples), self.timeout)
        except RewardFunctionError as err:
            missing = err.__cause__.args[0] if isinstance(err.__cause__, KeyError) and err.__cause__.args else None
            if missing in removed:  # a **kwargs function reading a removed column
                raise RewardFunctionError(f"{err}. {_removed_hint(missing)}") from err.__cause__
            raise

    def _check_removed_columns(self, removed: set[str]) -> None:
        """A function whose signature asks (without a default) for a column remove_unused_columns removed."""
        for name, func in zip(self.names, self.funcs):
            try:
                parameters = inspect.signature(func).parameters.values()
            except (TypeError, ValueError):  # builtins and some C callables have no signature
                continue
            for p in parameters:
                required = p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                if required and p.name in removed:
                    raise RewardFunctionError(
                        f"Reward function '{name}' takes the dataset column '{p.name}'. {_removed_hint(p.name)}"
                    )


def _check_shadowing(columns: dict[str, list], live: dict[str, list]) -> None:
    """Neither a dataset column nor a live column (rollout_func's fields) may take a keyword the trainer passes
    reward functions itself (RESERVED_COLUMNS): its value would be replaced, or the call would fail. The dataset's
    columns and rollout_func's fields are refused before this, by name; this is the last word."""
    for source, names in (("dataset column", columns), ("rollout_func field", live)):
        for name in names:
            if name in RESERVED_COLUMNS:
                raise ValueError(
                    f"A {source} is named '{name}', but reward functions receive the trainer's own '{name}' under "
                    f"that keyword (the trainer passes {', '.join(RESERVED_COLUMNS)} itself). Rename it."
                )


def _removed_hint(column: str) -> str:
    return (
        f"GRPOConfig.remove_unused_columns=True keeps the column '{column}' from reward functions (they get only "
        f"the prompt and {' / '.join(KEPT_COLUMNS)} columns, as in TRL); set remove_unused_columns=False to pass "
        "every dataset column."
    )
