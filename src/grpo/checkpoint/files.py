"""Reading a checkpoint back without trusting it: every file is loaded without unpickling arbitrary objects
(safetensors, JSON, or `torch.load(weights_only=True)`), checked, and any problem is one `CheckpointError` that
names the file, the problem and the next-newest complete checkpoint to resume from instead.

Only regular files are read (a symlink is followed to one): a FIFO, a device or a socket, or a symlink to one, is
refused without being opened, as it could block the resume or never end (`check_files` checks a whole checkpoint
before other libraries read it). A file is read within its size on disk: a JSON file up to `JSON_LIMIT` bytes, a
torch.save archive only with its entries stored as torch.save stores them (uncompressed, within the file), a
safetensors file as its header places its tensors within the file. JSON files are checked by their shape (every
entry grpo reads), not only parsed."""

from __future__ import annotations

import json
import os
import random
import re
import stat
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any, cast

import numpy as np
import torch
from safetensors.torch import load_file

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
STATE = "trainer_state.json"
INDEX = "model.safetensors.index.json"
# the most bytes a checkpoint's JSON file may hold: a log of about 170,000 rows in trainer_state.json (1.5 kB a row),
# far more than runs write; a crafted file of that size (`[{},{},...]`) parses into about 6 GB at most (25x)
JSON_LIMIT = 256 << 20
MAX_FILES = 100_000  # entries `check_files` examines in one checkpoint (symlinked directories included)


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


def checkpoint_of(path: str) -> str:
    """The checkpoint holding file `path`: its nearest directory named checkpoint-<step> (a file may be nested, as
    `reference/model.safetensors` or DeepSpeed's), else the directory it is in."""
    parent = directory = os.path.dirname(os.path.normpath(path))
    while directory and directory != os.path.dirname(directory):
        if CHECKPOINT.match(os.path.basename(directory)):
            return directory
        directory = os.path.dirname(directory)
    return parent


def read(path: str, what: str, reader: Callable[[str], Any]) -> Any:
    """reader(path), any failure turned into a CheckpointError naming the file, the problem and the fix. The file
    must be a regular one (a directory: every file under it), checked before the reader opens it."""
    try:
        if stat.S_ISDIR(os.stat(path).st_mode):
            check_files(path)
        else:
            regular(path)
        return reader(path)
    except CheckpointError:
        raise
    except FileNotFoundError:
        problem = "is missing"
    except Exception as err:  # a corrupt or crafted file: whatever the reader raised
        detail = str(err).splitlines()[0][:200] if str(err) else "no detail"
        problem = f"cannot be read as {what} ({type(err).__name__}: {detail})"
    raise CheckpointError(f"{path} {problem}. {next_newest(checkpoint_of(path))}")


def invalid(path: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{path}: {problem}. {next_newest(checkpoint_of(path))}")


# ---- only regular files, within their sizes -------------------------------------------------------------------

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def _not_regular(path: str, mode: int) -> CheckpointError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    what = f"is a symlink to {os.path.realpath(path)}, {kind}" if os.path.islink(path) else f"is {kind}"
    return invalid(
        path,
        f"{what}, not a regular file; a checkpoint's files are read only when they are regular files (reading "
        "this one could block the resume or never end)",
    )


def regular(path: str) -> os.stat_result:
    """os.stat of a checkpoint file about to be read, which must be a regular file (a symlink is followed to one):
    anything else is refused without being opened (opening a device can do something)."""
    status = os.stat(path)
    if not stat.S_ISREG(status.st_mode):
        raise _not_regular(path, status.st_mode)
    return status


@contextmanager
def open_regular(path: str) -> Iterator[tuple[IO[bytes], int]]:
    """The regular file at `path`, opened for reading, and its size: opened without blocking (had it been swapped
    for a FIFO since `regular`) and checked again once open."""
    regular(path)
    flags = os.O_RDONLY
    for name in ("O_NONBLOCK", "O_NOCTTY", "O_CLOEXEC", "O_BINARY"):  # those this system has
        flags |= getattr(os, name, 0)
    with os.fdopen(os.open(path, flags), "rb") as f:
        status = os.fstat(f.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise _not_regular(path, status.st_mode)
        yield f, status.st_size


def check_files(directory: str) -> None:
    """Every file under `directory` (a checkpoint, or a part of one that another library reads: torch.distributed
    checkpoint's shards, DeepSpeed's files, a PEFT adapter) is a regular file; symlinks are followed, each
    directory examined once. A dangling symlink is left for its reader to find missing."""
    seen: set[tuple[int, int]] = set()
    pending, count = [directory], 0
    while pending:
        folder = pending.pop()
        status = os.stat(folder)
        if (status.st_dev, status.st_ino) in seen:
            continue
        seen.add((status.st_dev, status.st_ino))
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            count += 1
            if count > MAX_FILES:
                raise invalid(path, f"is past the {MAX_FILES} files a checkpoint may hold")
            try:
                mode = os.stat(path).st_mode
            except FileNotFoundError:
                continue
            except OSError as err:  # a symlink loop, a name too long
                raise invalid(path, f"cannot be examined ({err.strerror or err})") from None
            if stat.S_ISDIR(mode):
                pending.append(path)
            elif not stat.S_ISREG(mode):
                raise _not_regular(path, mode)


def parse_json(path: str, parse_constant: Callable[[str], Any] | None = None) -> Any:
    """A regular JSON file of at most JSON_LIMIT bytes, parsed (its shape is the caller's to check); a file of
    another kind or size is a CheckpointError, a parse error is json's."""
    with open_regular(path) as (f, size):
        if size > JSON_LIMIT:
            raise invalid(path, f"is {size} bytes, more than the {JSON_LIMIT} a checkpoint's JSON file may hold")
        data = f.read(size)
    return json.loads(data) if parse_constant is None else json.loads(data, parse_constant=parse_constant)


def read_json(path: str, what: str = "JSON") -> Any:
    """`parse_json`, read as `read` reads a file (any failure a CheckpointError naming it)."""
    return read(path, what, parse_json)


def _stored_entries(f: IO[bytes], size: int) -> None:
    """A torch.save archive holds its entries uncompressed, within the file: a compressed entry could expand far
    past the file's size (torch would inflate it), so only such an archive is handed to torch.load."""
    if f.read(4) != b"PK\x03\x04":
        raise ValueError("it is not an archive as torch.save writes (a zip file)")
    f.seek(0)
    with zipfile.ZipFile(f) as archive:
        total = 0
        for entry in archive.infolist():
            if entry.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"its entry {entry.filename!r} is compressed, which torch.save never does")
            total += entry.file_size
            if entry.file_size != entry.compress_size or total > size:
                raise ValueError(f"its entries claim more bytes than the file's {size}")
    f.seek(0)


def load_tensors(path: str, what: str, device: Any = "cpu") -> Any:
    """A file written by torch.save, loaded weights-only: tensors, numbers, strings and containers, no code."""

    def load(p: str) -> Any:
        with open_regular(p) as (f, size):
            _stored_entries(f, size)
            return torch.load(f, map_location=device, weights_only=True)

    return read(path, what, load)


def load_safetensors(path: str) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors (on the CPU); safetensors checks that its header places them within the file.
    Read through the descriptor `open_regular` checked where the system names it (/proc/self/fd)."""
    with open_regular(path) as (f, _):
        same = f"/proc/self/fd/{f.fileno()}"
        return load_file(same if os.path.exists(same) else path)


def load_weights(path: str, what: str) -> dict[str, torch.Tensor]:
    """A checkpoint's safetensors file, read as `read` reads a file."""
    return read(path, what, load_safetensors)


# ---- trainer_state.json --------------------------------------------------------------------------------------

_COUNTS = ("global_step", "micro_step", "data_position", "num_input_tokens_seen", "num_processes", "dataset_size")


def read_state(checkpoint: str, max_steps: int, accumulation_steps: int) -> dict[str, Any]:
    """trainer_state.json, checked: what a hand edit or a corrupt write can break is refused here, not later."""
    path = os.path.join(checkpoint, STATE)
    state = read_json(path)
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
    if not is_number(flos) or not 0 <= flos < float("inf"):
        raise invalid(path, f"total_flos is {flos!r}; it must be a finite number >= 0")
    if not log_rows(state.get("log_history")):
        raise invalid(path, "log_history is not a list of rows, each with its step and numbers, strings or nulls")
    window = state.get("metrics_window")
    if not isinstance(window, dict) or not all(
        isinstance(v, list) and all(is_number(x) for x in v) for v in window.values()
    ):
        raise invalid(path, "metrics_window is not a mapping of names to lists of numbers")
    if not isinstance(state.get("config"), dict):
        raise invalid(path, "config is missing")
    _check_entries(path, state)
    return state


def is_number(value: Any) -> bool:
    """A JSON number that Python holds as a float (NaN and the infinities too): not a bool, nor an integer of 400
    digits."""
    if type(value) is float:
        return True
    if type(value) is not int:
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def log_rows(rows: Any) -> bool:
    """Whether `rows` is a log history as grpo logs it: rows with a whole step >= 0 and scalar values (the reward
    functions' copies of it are shallow)."""
    return isinstance(rows, list) and all(
        isinstance(row, dict)
        and type(row.get("step")) is int
        and row["step"] >= 0
        and all(v is None or isinstance(v, (str, bool)) or is_number(v) for v in row.values())
        for row in rows
    )


def _check_entries(path: str, state: dict[str, Any]) -> None:
    """The entries of trainer_state.json that grpo reads besides the counts, log and config: each absent (an
    older checkpoint) or of its shape."""
    control = state.get("entropy_control")
    if control is not None and not (
        isinstance(control, dict)
        and (
            not control
            or (
                is_number(control.get("entropy_coef"))
                and (control.get("last_world_entropy") is None or is_number(control["last_world_entropy"]))
            )
        )
    ):
        raise invalid(
            path, f"entropy_control is {control!r:.100}; it must be {{}} or an entropy_coef and a last_world_entropy"
        )
    callbacks = state.get("stateful_callbacks")
    if callbacks is not None and not (
        isinstance(callbacks, dict)
        and all(
            all(_callback_state(s) for s in (saved if isinstance(saved, list) else [saved]))
            for saved in callbacks.values()
        )
    ):
        raise invalid(
            path,
            f"stateful_callbacks is {callbacks!r:.100}; it must map callback names to their states (an object with "
            "args and attributes objects, or a list of them)",
        )
    for key in ("save_only_model", "rollouts"):
        if state.get(key) is not None and type(state[key]) is not bool:
            raise invalid(path, f"{key} is {state[key]!r:.100}; it must be true or false")
    if "num_items" in state and not is_number(state["num_items"]):
        raise invalid(path, f"num_items is {state['num_items']!r:.100}; it must be a number")


def _callback_state(saved: Any) -> bool:
    return (
        isinstance(saved, dict)
        and isinstance(saved.get("args", {}), dict)
        and isinstance(saved.get("attributes") or {}, dict)
    )


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
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        files = weight_index(index)
    else:
        files = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
    if not files:
        raise invalid(path, "holds no model weights (*.safetensors)")
    saved: dict[str, torch.Tensor] = {}
    for name in files:
        saved.update(load_weights(os.path.join(path, name), "safetensors weights"))
    return saved


def weight_index(index: str) -> list[str]:
    """The safetensors files model.safetensors.index.json names: its weight_map, an object mapping each tensor to a
    file beside it (a plain name ending in .safetensors)."""
    meta = read_json(index, "a safetensors index")
    if not isinstance(meta, dict):
        raise invalid(index, f"holds a {type(meta).__name__}, not an object with a weight_map")
    weight_map = meta.get("weight_map")
    if not isinstance(weight_map, dict):
        raise invalid(
            index, f"its weight_map is not an object mapping tensor names to files (it is {weight_map!r:.100})"
        )
    for tensor, name in weight_map.items():
        plain = isinstance(name, str) and os.path.basename(name) == name and "/" not in name and "\\" not in name
        if not plain or not name.endswith(".safetensors") or name.startswith("."):
            raise invalid(
                index, f"maps {tensor!r:.100} to {name!r:.100}, not the name of a .safetensors file beside it"
            )
    return sorted(set(weight_map.values()))


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
