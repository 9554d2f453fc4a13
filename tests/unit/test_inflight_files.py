"""The in-flight rounds of an asynchronous checkpoint (`grpo.checkpoint.inflight`), as a careless hand or a hostile
file would leave them: every field checked against the checkpoint's data position and max_staleness, the weights'
file read whole and finite, and the two files together or not at all. Each is one CheckpointError naming the file
(the damaged one) and the next-newest complete checkpoint, raised while the checkpoint is read, before anything
trains."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import TrainerState

from grpo.checkpoint import inflight
from grpo.checkpoint.files import STATE, CheckpointError
from grpo.checkpoint.inflight import Publication

PARAMS = {"layer.weight": torch.zeros(3, 2), "layer.bias": torch.zeros(3)}
FILE = "inflight_0"


def saved(tmp_path):
    """checkpoint-3 of a run with max_staleness 2 (publications 1 and 2, as rounds 3 and 4 sample them), beside
    a complete checkpoint-1."""
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / STATE).write_text("{}")
    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    torch.manual_seed(0)
    weights = {k: {name: torch.randn_like(p) for name, p in PARAMS.items()} for k in (0, 1)}
    pubs = {p: Publication(p - 1, 5 + p, p, TrainerState(global_step=p)) for p in (1, 2)}
    inflight.write(str(checkpoint), FILE, 2, 3, pubs, weights)
    return checkpoint, weights


def read(checkpoint):
    return inflight.read(str(checkpoint), FILE, 2, PARAMS, 3)


def refused(checkpoint, match):
    with pytest.raises(CheckpointError, match=match) as err:
        read(checkpoint)
    assert "next-newest complete checkpoint is" in str(err.value) and "checkpoint-1" in str(err.value)


def test_the_files_as_written_read_back(tmp_path):
    checkpoint, weights = saved(tmp_path)
    pubs, read_weights = read(checkpoint)
    assert sorted(pubs) == [1, 2] and [pubs[p].step for p in (1, 2)] == [1, 2]
    assert pubs[2].version is None and pubs[2].state.global_step == 2
    for key in (0, 1):
        for name in PARAMS:
            assert torch.equal(read_weights[key][name], weights[key][name])


def edit(meta, case):
    pubs = meta["publications"]
    if case == "an infinite step":
        return json.dumps(meta).replace('"step": 2', '"step": Infinity')
    if case == "100,000 nested brackets":
        return "[" * 100_000 + "]" * 100_000
    if case == "negative positions":
        meta["publications"] = {str(-int(p)): pub for p, pub in pubs.items()}
    elif case == "positions past the checkpoint's":
        meta["publications"] = {str(int(p) + 3): pub for p, pub in pubs.items()}
    elif case == "another data position":
        meta["data_position"] = 7
    elif case == "a step that is a string":
        pubs["2"]["step"] = "2"
    elif case == "a negative weights key":
        pubs["2"]["weights"] = -1
    elif case == "not an object":
        return "[1, 2]"
    elif case == "a trainer state whose step is a string":
        pubs["2"]["state"]["global_step"] = "2"
    elif case == "a trainer state whose log is a string":
        pubs["2"]["state"]["log_history"] = "rows"
    elif case == "a trainer state with a field TrainerState lacks":
        pubs["2"]["state"]["run_code"] = True
    elif case == "a max_staleness that is a list":
        meta["max_staleness"] = [2]
    return json.dumps(meta)


CRAFTED = {
    "an infinite step": "Infinity, not a number JSON allows",
    "100,000 nested brackets": "nested too deeply",
    "negative positions": r"publication '-1' is not a round a checkpoint at data position 3 with max_staleness=2",
    "positions past the checkpoint's": r"publication '4' is not a round .*\(1\.\.3\)",
    "another data position": "data_position 7 is not the checkpoint's",
    "a step that is a string": "publication 2's step is '2', not a count",
    "a negative weights key": "publication 2's weights is -1, not a count",
    "not an object": "holds a list, not an object",
    "a trainer state whose step is a string": "publication 2's trainer state has global_step '2', not a count",
    "a trainer state whose log is a string": "publication 2's log_history is not a list of rows",
    "a trainer state with a field TrainerState lacks": "'run_code', not a field of TrainerState",
    "a max_staleness that is a list": r"its max_staleness is \[2\], not a count",
}


@pytest.mark.parametrize("case", CRAFTED)
def test_a_crafted_json_file_is_refused_naming_it(tmp_path, case):
    checkpoint, _ = saved(tmp_path)
    path = checkpoint / f"{FILE}.json"
    path.write_text(edit(json.loads(path.read_text()), case))
    refused(checkpoint, rf"{FILE}\.json: cannot be read as in-flight rounds \(.*{CRAFTED[case]}")


def test_publications_out_of_the_window_are_refused_even_at_the_files_own_position(tmp_path):
    """Renumbered publications with a data_position to match are still checked against the checkpoint's."""
    checkpoint, _ = saved(tmp_path)
    path = checkpoint / f"{FILE}.json"
    meta = json.loads(path.read_text())
    meta["publications"] = {"0": meta["publications"]["1"], "2": meta["publications"]["2"]}
    path.write_text(json.dumps(meta))
    refused(checkpoint, r"publication '0' is not a round a checkpoint at data position 3 .*\(1\.\.3\)")


@pytest.mark.parametrize("damage", ["truncated", "a garbage header", "NaN weights"])
def test_a_damaged_weights_file_is_refused_naming_it(tmp_path, damage):
    checkpoint, weights = saved(tmp_path)
    path = checkpoint / f"{FILE}.tensors"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:-20])
    elif damage == "a garbage header":
        path.write_bytes(b"\xff" * 8 + path.read_bytes()[8:])
    else:
        from safetensors.torch import save_file

        tensors = {f"{k}/{name}": t for k, w in weights.items() for name, t in w.items()}
        tensors["1/layer.bias"] = torch.full((3,), float("nan"))
        save_file(tensors, str(path))
    match = "not finite numbers" if damage == "NaN weights" else "cannot be read as in-flight rounds"
    refused(checkpoint, rf"{FILE}\.tensors: .*{match}")  # the file that is damaged, not its companion


def test_weights_missing_for_a_publication_name_the_weights_file(tmp_path):
    checkpoint, weights = saved(tmp_path)
    from safetensors.torch import save_file

    save_file({f"0/{name}": t for name, t in weights[0].items()}, str(checkpoint / f"{FILE}.tensors"))
    refused(checkpoint, rf"{FILE}\.tensors: .*does not hold in full the weights that publication 2 of {FILE}\.json")
    (checkpoint / f"{FILE}.tensors").unlink()
    refused(checkpoint, rf"{FILE}\.tensors: is missing, while {FILE}\.json is there")


def test_weights_without_their_publications_are_refused(tmp_path):
    """An asynchronous checkpoint that lost inflight_<rank>.json is not a sequential run's: refused, naming it
    (resuming would regenerate the rounds after it from the wrong policy)."""
    checkpoint, _ = saved(tmp_path)
    (checkpoint / f"{FILE}.json").unlink()
    refused(checkpoint, rf"{FILE}\.json: is missing, while {FILE}\.tensors is there")
    (checkpoint / f"{FILE}.tensors").unlink()  # neither: a sequential run's checkpoint, resumed on-policy
    assert read(checkpoint) is None
