"""The in-flight rounds of an asynchronous run in a checkpoint (`grpo.rounds.asynchronous`): the publications that the
rounds after it sample from, `inflight_<rank>.json` (their steps, trainer states and which weights) and
`inflight_<rank>.tensors` (those weights, in safetensors' format). What a hand edit or a crafted file can break is
refused here, naming the file, before anything is restored."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file, save_file
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


def read(checkpoint: str, file: str, staleness: int, params: dict[str, torch.Tensor]) -> Any:
    """`write`'s publications and weights (None for a sequential run's checkpoint), checked against this run's
    max_staleness and trained parameters `params` (names, shapes; loaded to their devices and dtypes)."""
    meta_path = os.path.join(checkpoint, file + ".json")
    if not os.path.exists(meta_path):  # a sequential run's checkpoint: the next rounds sample the resumed policy
        logger.warning("%s has no in-flight rounds (a sequential run's): async resumes on-policy.", checkpoint)
        return None
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        tensors = load_file(os.path.join(checkpoint, file + ".tensors"))
        if meta["max_staleness"] != staleness:
            raise files.invalid(
                meta_path,
                f"was written with max_staleness={meta['max_staleness']}, this run has {staleness}: the rounds after "
                "the checkpoint would sample other weights. Resume with the same max_staleness",
            )
        weights: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            wid, _, name = key.partition("/")
            if name not in params or tensor.shape != params[name].shape or not wid.isdigit():
                raise ValueError(f"it holds {key!r} {tuple(tensor.shape)}, not a trained parameter of the model")
            # a tensor of its own, allocated as the publications' clones are (the snapshot samples it in place, and
            # a kernel's result may depend on its memory's alignment, which a tensor read from the file does not have)
            value = torch.empty_like(params[name]).copy_(tensor)
            weights.setdefault(int(wid), {})[name] = value
        pubs = {}
        for p, pub in meta["publications"].items():
            if set(weights.get(pub["weights"], ())) != set(params):
                raise ValueError(f"publication {p} names weights the file does not hold in full")
            pubs[int(p)] = Publication(pub["weights"], None, int(pub["step"]), TrainerState(**pub["state"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        if isinstance(error, files.CheckpointError):
            raise
        raise files.invalid(meta_path, f"cannot be read as in-flight rounds ({error})") from error
    return pubs, weights


def _state_json(state: TrainerState) -> dict[str, Any]:
    fields = {f.name for f in dataclasses.fields(TrainerState)}
    return {k: v for k, v in dataclasses.asdict(state).items() if k in fields}
