"""What a `rollout_func` returns, checked before anything uses it (TRL 1.16's contract: a dict of `prompt_ids`,
`completion_ids` and `logprobs`, one list per prompt, and any further fields for reward functions).

Each malformed entry is one ValueError naming the field, the row (and position), the value and the rule, where the
tensors built from it would otherwise fail deep inside with a bare IndexError or TypeError, or train silently on
wrong numbers:

- token ids are ints (not bool, float, None or lists) in [0, V), V the policy's vocabulary (its embedding rows);
- a prompt has at least one token (the first completion token is scored from the tokens before it); a completion
  may be empty (nothing to train: it counts as truncated);
- `logprobs` (and `env_mask`, when given) have one entry per completion token; a log-prob is a finite number <= 0
  (up to `LOGP_ROUNDING`); an env_mask entry is 0 or 1;
- a further field may not take the name of a keyword the trainer itself passes reward functions
  (`grpo.data.prompts.RESERVED_COLUMNS`, and `environments` with environment_factory): it would shadow the trainer's
  value (or, for trainer_state / log_metric / log_extra, make the call fail).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from grpo.data.prompts import RESERVED_COLUMNS

ROLLOUT_KEYS = ("prompt_ids", "completion_ids", "logprobs")
MASK_KEY = "env_mask"
LOGP_ROUNDING = 1e-5  # a log-prob this far above 0 is float rounding of log(1), not a probability or a logit


def policy_vocab_size(model: Any, tokenizer: Any) -> int:
    """How many token ids the policy can embed and score: the smaller of its input embedding's rows and its output
    head's width, else its (text) config's vocab_size, else the tokenizer's length."""
    sizes = []
    for get, attribute in (("get_input_embeddings", "num_embeddings"), ("get_output_embeddings", "out_features")):
        try:
            module = getattr(model, get)()
        except (AttributeError, NotImplementedError, TypeError):
            continue
        size = getattr(module, attribute, None)
        if isinstance(size, int) and size > 0:
            sizes.append(size)
    if sizes:
        return min(sizes)
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return int(size) if isinstance(size, int) and size > 0 else len(tokenizer)


def check_extra_keys(output: dict, environments: bool) -> None:
    """A further field named like a keyword the trainer passes reward functions itself is refused, naming it."""
    reserved = RESERVED_COLUMNS + (("environments",) if environments else ())
    for key in output:
        if key in reserved and key not in ROLLOUT_KEYS:  # completion_ids: the rollout's own, what rewards get
            raise ValueError(
                f"rollout_func returned a field '{key}', but reward functions receive the trainer's own '{key}' "
                f"under that keyword (the trainer passes {', '.join(reserved)} itself). Rename the field, e.g. "
                f"'my_{key}': reward functions then get it under that name."
            )


def rows(output: dict, key: str, n: int) -> list:
    """output[key]: a list (or tuple) with one entry per prompt."""
    value = output[key]
    if not isinstance(value, (list, tuple)) or len(value) != n:
        got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
        raise ValueError(f"rollout_func's '{key}' must be a list with one entry per prompt ({n} here); got {got}.")
    return list(value)


def _as_list(value: Any, key: str, i: int, what: str) -> list:
    if not isinstance(value, (list, tuple)) and hasattr(value, "tolist") and getattr(value, "ndim", None) == 1:
        value = value.tolist()  # a 1-D tensor or array
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"rollout_func returned {key}[{i}] = {value!r:.80} ({type(value).__name__}), not a list of {what}; "
            f"give each row's {what} as a list."
        )
    return list(value)


def token_ids(value: Any, key: str, i: int, vocab_size: int) -> list[int]:
    """Row i of prompt_ids / completion_ids as a list of ints, each checked."""
    ids = _as_list(value, key, i, "token ids")
    if all(type(t) is int for t in ids) and (not ids or (min(ids) >= 0 and max(ids) < vocab_size)):
        return ids  # the common case, checked without a Python loop of its own
    out = []
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(
                f"rollout_func returned {key}[{i}][{j}] = {t!r:.80} ({type(t).__name__}); token ids are ints in "
                f"[0, {vocab_size}) (each row a flat list of them)."
            )
        t = int(t)
        if t < 0:
            raise ValueError(
                f"rollout_func returned {key}[{i}][{j}] = {t}, a negative id; token ids are in [0, {vocab_size}), "
                "the policy's vocabulary."
            )
        if t >= vocab_size:
            raise ValueError(
                f"rollout_func returned {key}[{i}][{j}] = {t}, past the policy's vocabulary of {vocab_size} ids; "
                f"token ids are in [0, {vocab_size}). Tokenize with the policy's own tokenizer "
                "(trainer.processing_class)."
            )
        out.append(t)
    return out


def log_probs(value: Any, i: int) -> list[float]:
    """Row i of logprobs as floats, each checked."""
    values = _as_list(value, "logprobs", i, "log-probabilities")
    out = []
    for j, x in enumerate(values):
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise ValueError(
                f"rollout_func returned logprobs[{i}][{j}] = {x!r:.80} ({type(x).__name__}); a log-probability is a "
                "number: the sampler's log-prob of that completion token."
            )
        x = float(x)
        if not math.isfinite(x):
            raise ValueError(
                f"rollout_func returned logprobs[{i}][{j}] = {x}; a log-probability is finite (<= 0): give the "
                "sampler's log-prob of each completion token."
            )
        if x > LOGP_ROUNDING:
            raise ValueError(
                f"rollout_func returned logprobs[{i}][{j}] = {x}, positive; a log-probability is <= 0 (a probability "
                "or a logit is not one: give log p of each sampled token)."
            )
        out.append(min(x, 0.0))
    return out


def mask_row(value: Any, i: int) -> list[int]:
    entries = _as_list(value, MASK_KEY, i, "mask entries")
    for j, m in enumerate(entries):
        if not isinstance(m, numbers.Integral) or m not in (0, 1):
            raise ValueError(
                f"rollout_func returned {MASK_KEY}[{i}][{j}] = {m!r:.80}; a mask entry is 0 or 1 (1: a token the "
                "model sampled, trained; 0: a token from elsewhere, e.g. a tool's output, not trained)."
            )
    return [int(m) for m in entries]


def check_lengths(i: int, completion: Sequence, logprobs: Sequence, mask: Sequence | None) -> None:
    if len(logprobs) != len(completion) or (mask is not None and len(mask) != len(completion)):
        raise ValueError(
            f"rollout_func: row {i} has {len(completion)} completion ids but {len(logprobs)} logprobs"
            + ("" if mask is None else f" and {len(mask)} {MASK_KEY} entries")
            + ": give one per completion token."
        )


def checked(output: Any, n: int, vocab_size: int, environments: bool = False) -> tuple[list, list, list, list | None]:
    """(prompt_ids, completion_ids, logprobs, env_mask or None) of rollout_func's `output` for `n` prompts, every
    entry checked (module docstring)."""
    if not isinstance(output, dict):
        raise ValueError(
            f"rollout_func must return a dict with keys {list(ROLLOUT_KEYS)}; it returned {type(output).__name__}."
        )
    missing = [k for k in ROLLOUT_KEYS if k not in output]
    if missing:
        raise ValueError(
            f"rollout_func must return keys {sorted(missing)} in its output dict (it returned {sorted(output)})."
        )
    check_extra_keys(output, environments)
    prompts, completions, logprobs = (rows(output, k, n) for k in ROLLOUT_KEYS)
    masks = rows(output, MASK_KEY, n) if output.get(MASK_KEY) is not None else None
    for i in range(n):
        prompts[i] = token_ids(prompts[i], "prompt_ids", i, vocab_size)
        if not prompts[i]:
            raise ValueError(
                f"rollout_func returned prompt_ids[{i}] = [], an empty prompt; every completion follows at least one "
                "prompt token (the policy scores each completion token from the tokens before it)."
            )
        completions[i] = token_ids(completions[i], "completion_ids", i, vocab_size)
        logprobs[i] = _as_list(logprobs[i], "logprobs", i, "log-probabilities")
        if masks is not None:
            masks[i] = _as_list(masks[i], MASK_KEY, i, "mask entries")
        check_lengths(i, completions[i], logprobs[i], None if masks is None else masks[i])
        logprobs[i] = log_probs(logprobs[i], i)
        if masks is not None:
            masks[i] = mask_row(masks[i], i)
    return prompts, completions, logprobs, masks
