"""The in-flight rounds of an asynchronous run in a checkpoint (`grpo.rounds.asynchronous`): the publications that the
rounds after it sample from, `inflight_<rank>.json` (their steps, trainer states and which weights) and
`inflight_<rank>.tensors` (those weights, in safetensors' format). What a hand edit or a crafted file can break is
refused here, naming the file, before anything is restored."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from transformers import TrainerState

from grpo.checkpoint import files

logger = logging.getLogger("grpo")


@dataclass
class Publication:
    """The learner's policy when it asked for a round: which weights, its policy version and optimizer step, and
    the trainer state reward functions see for the rounds that sample it."""

    weights: int  # key of `AsyncRounds.weights`
    version: int | None  # None: restored from a checkpoint (the saving process's numbering)
    step: int
    state: TrainerState


def write(
    directory: str, file: str, staleness: int, position: int, pubs: dict[int, Publication], weights: dict
) -> None:
    """Publications `pubs` (of rounds from data position `position`) and the weights they name, into `directory`."""
    tensors = {f"{k}/{name}": t.contiguous().cpu() for k, w in weights.items() for name, t in w.items()}
    meta = {
        "max_staleness": staleness,
        "data_position": position,
        "publications": {
            str(p): dict(weights=pub.weights, step=pub.step, state=_state_json(pub.state)) for p, pub in pubs.items()
        },
    }
    save_file(tensors, os.path.join(directory, file + ".tensors"))
    with open(os.path.join(directory, file + ".json"), "w") as f:
        json.dump(meta, f)


def read(
    checkpoint: str, file: str, staleness: int, params: Mapping[str, torch.Tensor], position: int | None = None
) -> Any:
    """`write`'s publications and weights (None for a sequential run's checkpoint), checked against this run's
    max_staleness, the checkpoint's data `position` and trained parameters `params` (names, shapes, finite values;
    loaded to their devices and dtypes). Anything else is one CheckpointError naming the file."""
    meta_path = os.path.join(checkpoint, file + ".json")
    tensors_path = os.path.join(checkpoint, file + ".tensors")
    if not os.path.exists(meta_path):
        if os.path.exists(tensors_path):  # an asynchronous run's checkpoint that lost half its in-flight rounds
            raise files.invalid(
                meta_path,
                f"is missing, while {file}.tensors is there: the rounds after this checkpoint cannot be sampled "
                "from the policies they were. Restore the file, or resume from another checkpoint",
            )
        # a sequential run's checkpoint: the next rounds sample the resumed policy
        logger.warning("%s has no in-flight rounds (a sequential run's): async resumes on-policy.", checkpoint)
        return None
    listed = _read_meta(meta_path, staleness, position)
    if not os.path.exists(tensors_path):
        raise files.invalid(
            tensors_path,
            f"is missing, while {file}.json is there: the rounds after this checkpoint cannot be sampled from the "
            "policies they were. Restore the file, or resume from another checkpoint",
        )
    try:
        weights = _read_weights(tensors_path, params)
        for p, pub in listed.items():
            if set(weights.get(pub.weights, ())) != set(params):
                raise ValueError(f"it does not hold in full the weights that publication {p} of {file}.json names")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError, SafetensorError) as error:
        if isinstance(error, files.CheckpointError):
            raise
        raise files.invalid(tensors_path, f"cannot be read as in-flight rounds' weights ({error})") from None
    return listed, weights


def _read_meta(meta_path: str, staleness: int, position: int | None) -> dict[int, Publication]:
    """The publications of `file`.json, every field checked (their trainer states by their fields' kinds)."""
    try:
        meta = files.parse_json(meta_path, parse_constant=_no_constant)
        if not isinstance(meta, dict):
            raise ValueError(f"it holds a {type(meta).__name__}, not an object")
        if meta.get("max_staleness") != staleness:
            if type(meta.get("max_staleness")) is not int:
                raise ValueError(f"its max_staleness is {meta.get('max_staleness')!r:.100}, not a count")
            raise files.invalid(
                meta_path,
                f"was written with max_staleness={meta['max_staleness']}, this run has {staleness}: the rounds after "
                "the checkpoint would sample other weights. Resume with the same max_staleness",
            )
        listed = _publications(meta, staleness, position)
        return {
            p: Publication(pub["weights"], None, pub["step"], TrainerState(**pub["state"])) for p, pub in listed.items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        if isinstance(error, files.CheckpointError):
            raise
        problem = "nested too deeply" if isinstance(error, RecursionError) else error
        raise files.invalid(meta_path, f"cannot be read as in-flight rounds ({problem})") from None


def _read_weights(tensors_path: str, params: Mapping[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """The weights of `file`.tensors by key, each a trained parameter's name and shape, with finite values."""
    tensors = files.load_safetensors(tensors_path)
    weights: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        wid, _, name = key.partition("/")
        if name not in params or tensor.shape != params[name].shape or not wid.isdigit():
            raise ValueError(f"it holds {key!r} {tuple(tensor.shape)}, not a trained parameter of the model")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(f"it holds values of {key!r} that are not finite numbers")
        # a tensor of its own, allocated as the publications' clones are (the snapshot samples it in place, and
        # a kernel's result may depend on its memory's alignment, which a tensor read from the file does not have)
        value = torch.empty_like(params[name]).copy_(tensor)
        weights.setdefault(int(wid), {})[name] = value
    return weights


def _no_constant(name: str) -> Any:
    raise ValueError(f"it holds {name}, not a number JSON allows")


def _publications(meta: dict, staleness: int, position: int | None) -> dict[int, dict]:
    """The publications, each field checked against the checkpoint's data position and max_staleness: a round
    from the checkpoint's position on samples a publication made at most max_staleness rounds before it."""
    start = meta["data_position"]
    if type(start) is not int or start < 0 or (position is not None and start != position):
        raise ValueError(f"its data_position {start!r} is not the checkpoint's ({position})")
    listed = meta["publications"]
    if not isinstance(listed, dict):
        raise ValueError("its publications are not an object")
    first = max(start - staleness, 0)
    out = {}
    for p, pub in listed.items():
        if not p.isdigit() or not first <= int(p) <= start:
            raise ValueError(
                f"publication {p!r} is not a round a checkpoint at data position {start} with max_staleness="
                f"{staleness} holds ({first}..{start})"
            )
        if not isinstance(pub, dict) or not isinstance(pub.get("state"), dict):
            raise ValueError(f"publication {p} is not an object with a trainer state")
        for key in ("weights", "step"):
            if type(pub.get(key)) is not int or pub[key] < 0:
                raise ValueError(f"publication {p}'s {key} is {pub.get(key)!r}, not a count")
        _check_state(p, pub["state"])
        out[int(p)] = pub
    return out


# a publication's trainer state (reward functions read it): each field of TrainerState that it holds, by its kind
_COUNT, _NUMBER, _FLAG, _TEXT, _OBJECT = "a count", "a number", "true or false", "a string", "an object"
_STATE_FIELDS = {
    **dict.fromkeys(("global_step", "max_steps", "num_input_tokens_seen", "best_global_step"), _COUNT),
    **dict.fromkeys(("epoch", "logging_steps", "eval_steps", "save_steps", "train_batch_size"), _NUMBER),
    **dict.fromkeys(("num_train_epochs", "total_flos", "best_metric"), _NUMBER),
    **dict.fromkeys(("is_local_process_zero", "is_world_process_zero", "is_hyper_param_search"), _FLAG),
    **dict.fromkeys(("best_model_checkpoint", "trial_name"), _TEXT),
    **dict.fromkeys(("trial_params", "stateful_callbacks"), _OBJECT),
}
_KIND_CHECKS = {
    _COUNT: lambda v: type(v) is int and v >= 0,
    _NUMBER: files.is_number,
    _FLAG: lambda v: type(v) is bool,
    _TEXT: lambda v: isinstance(v, str),
    _OBJECT: lambda v: isinstance(v, dict),
}


def _check_state(p: str, state: dict[str, Any]) -> None:
    """A publication's trainer state: TrainerState's fields only, each null or of its kind, the log history as
    trainer_state.json's (a field this table does not know, of a later transformers, is any JSON value)."""
    known = {f.name for f in dataclasses.fields(TrainerState)}
    for key, value in state.items():
        if key not in known:
            raise ValueError(f"publication {p}'s trainer state has {key!r:.100}, not a field of TrainerState")
        if value is None:
            continue
        if key == "log_history":
            if not files.log_rows(value):
                raise ValueError(f"publication {p}'s log_history is not a list of rows, each with its step")
        elif key in _STATE_FIELDS and not _KIND_CHECKS[_STATE_FIELDS[key]](value):
            raise ValueError(f"publication {p}'s trainer state has {key} {value!r:.100}, not {_STATE_FIELDS[key]}")


def _state_json(state: TrainerState) -> dict[str, Any]:
    fields = {f.name for f in dataclasses.fields(TrainerState)}
    return {k: v for k, v in dataclasses.asdict(state).items() if k in fields}
