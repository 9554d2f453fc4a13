"""Reading a checkpoint back without trusting it: every file is loaded without unpickling arbitrary objects
(safetensors, JSON, or `torch.load(weights_only=True)`), checked, and any problem is one `CheckpointError` that
names the file, the problem and the next-newest complete checkpoint to resume from instead."""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
from safetensors.torch import load_file

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
STATE = "trainer_state.json"


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from (missing, unreadable or inconsistent files, or it does not fit the run);
    the message names the file and what to do."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit this model or run; the message names what differs."""


def checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints under root, oldest first."""
    if not os.path.isdir(root):
        return []
    found = [
        (int(m.group(1)), os.path.join(root, name))
        for name in os.listdir(root)
        if (m := CHECKPOINT.match(name)) and os.path.exists(os.path.join(root, name, STATE))
    ]
    return sorted(found)


def next_newest(path: str) -> str:
    """Where to resume instead of the checkpoint at `path`: a sentence naming the next-newest complete one."""
    path = os.path.normpath(path)
    older = [
        p for step, p in checkpoints(os.path.dirname(path)) if os.path.normpath(p) != path and step < _step_of(path)
    ]
    if older:
        return f"The next-newest complete checkpoint is {older[-1]}: resume_from_checkpoint={older[-1]!r}."
    return f"There is no older complete checkpoint in {os.path.dirname(path) or '.'}: train without resuming."


def _step_of(path: str) -> float:
    m = CHECKPOINT.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else float("inf")


def read(path: str, what: str, reader: Callable[[str], Any]) -> Any:
    """reader(path), any failure turned into a CheckpointError naming the file, the problem and the fix."""
    try:
        return reader(path)
    except CheckpointError:
        raise
    except FileNotFoundError:
        problem = "is missing"
    except Exception as err:  # a corrupt or crafted file: whatever the reader raised
        detail = str(err).splitlines()[0][:200] if str(err) else "no detail"
        problem = f"cannot be read as {what} ({type(err).__name__}: {detail})"
    raise CheckpointError(f"{path} {problem}. {next_newest(os.path.dirname(path))}")


def load_tensors(path: str, what: str, device: Any = "cpu") -> Any:
    """A file written by torch.save, loaded weights-only: tensors, numbers, strings and containers, no code."""
    return read(path, what, lambda p: torch.load(p, map_location=device, weights_only=True))


def invalid(path: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{path}: {problem}. {next_newest(os.path.dirname(path))}")


# ---- trainer_state.json --------------------------------------------------------------------------------------

_COUNTS = ("global_step", "micro_step", "data_position", "num_input_tokens_seen", "num_processes", "dataset_size")


def read_state(checkpoint: str, max_steps: int, accumulation_steps: int) -> dict[str, Any]:
    """trainer_state.json, checked: what a hand edit or a corrupt write can break is refused here, not later."""
    path = os.path.join(checkpoint, STATE)
    state = read(path, "JSON", lambda p: json.loads(open(p).read()))
    if not isinstance(state, dict):
        raise invalid(path, f"holds a {type(state).__name__}, not the trainer state object")
    for key in _COUNTS:
        value = state.get(key)
        if key == "dataset_size" and value is None:  # a streaming dataset has no size
            continue
        if type(value) is not int or value < 0:
            raise invalid(path, f"{key} is {value!r}; it must be a whole number >= 0")
    step = state["global_step"]
    named = _step_of(checkpoint)
    if step < 1 or (named != float("inf") and step != named):
        raise invalid(path, f"global_step is {step}, but the directory is {os.path.basename(checkpoint)}")
    if step > max_steps:
        raise invalid(
            path, f"global_step is {step}, past this run's max_steps ({max_steps}); raise max_steps to train on from it"
        )
    if state["micro_step"] != step * accumulation_steps:
        raise invalid(
            path,
            f"micro_step is {state['micro_step']}, but {step} steps of {accumulation_steps} "
            f"accumulated micro-steps make {step * accumulation_steps}",
        )
    flos = state.get("total_flos", 0.0)  # absent from checkpoints written before it was saved
    if type(flos) not in (int, float) or not 0 <= flos < float("inf"):
        raise invalid(path, f"total_flos is {flos!r}; it must be a finite number >= 0")
    if not isinstance(state.get("log_history"), list) or not all(isinstance(r, dict) for r in state["log_history"]):
        raise invalid(path, "log_history is not a list of rows")
    window = state.get("metrics_window")
    if not isinstance(window, dict) or not all(
        isinstance(v, list) and all(isinstance(x, (int, float)) for x in v) for v in window.values()
    ):
        raise invalid(path, "metrics_window is not a mapping of names to lists of numbers")
    if not isinstance(state.get("config"), dict):
        raise invalid(path, "config is missing")
    return state


# ---- random number generator states: plain numbers and tensors only -------------------------------------------


def rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain numbers (loadable weights-only)."""
    version, mt, gauss = random.getstate()
    # legacy=True (the default) gives the tuple, not the dict
    kind, key, pos, has_gauss, cached = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    state = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    np.random.set_state(
        (npy["kind"], npy["key"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_rng_state(path: str) -> dict[str, Any]:
    state = load_tensors(path, "random generator states")
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= set(state):
        raise invalid(path, "is not a set of random generator states")
    return state


# ---- model weights ---------------------------------------------------------------------------------------------


def load_weight_files(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files (sharded with an index, or not)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read(index, "JSON", lambda p: json.loads(open(p).read())).get("weight_map", {})
        files = sorted(set(weight_map.values()))
    else:
        files = [name for name in os.listdir(path) if name.endswith(".safetensors")]
    if not files:
        raise invalid(path, "holds no model weights (*.safetensors)")
    saved: dict[str, torch.Tensor] = {}
    for name in files:
        saved.update(read(os.path.join(path, name), "safetensors weights", load_file))
    return saved


def apply(path: str, name: str, load_state: Callable[[], Any]) -> None:
    """Run `load_state` (a load_state_dict of what file `name` of checkpoint `path` held); a state that does not
    fit is an error naming the file."""
    try:
        load_state()
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as err:
        raise invalid(
            os.path.join(path, name),
            f"does not fit this run ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200] if str(err) else 'no detail'})",
        ) from None
