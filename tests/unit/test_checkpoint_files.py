"""A checkpoint's files as a hostile archive or a careless hand would leave them (`grpo.checkpoint.files`): every JSON
file checked by its shape, not only parsed; only regular files read (a FIFO, a device, a symlink to one refused
without being opened), within their sizes. Each problem is one CheckpointError naming the file and the next-newest
complete checkpoint, raised while the checkpoint is read.

The hostile cases run in a forked child whose address space is capped: a reader that blocked on a FIFO or read
/dev/zero without end would hang or fill the memory of the test run; here it is killed (the hang guard) or stopped by
the cap, and the test fails."""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import zipfile

import pytest
import torch
from safetensors.torch import save_file
from transformers import TrainerState

from grpo.checkpoint import files, inflight
from grpo.checkpoint.files import STATE
from grpo.checkpoint.inflight import Publication

INDEX = "model.safetensors.index.json"
HANG_GUARD_S = 60  # a reader still running after this is taken to hang (the fixed readers answer at once)
needs_fork = pytest.mark.skipif(not os.path.exists("/proc/self/status") or not hasattr(os, "mkfifo"), reason="Linux")


def _address_space() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def _child(call, send) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _address_space() + (1 << 30)  # 1 GiB more than the forked process maps already
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        call()
        send.send(("returned", ""))
    except BaseException as err:  # reported to the parent, which asserts on it
        send.send((type(err).__name__, str(err)))


def outcome(call) -> tuple[str, str]:
    """(exception class name, message) of call() run in a forked child with a capped address space; ("returned",
    "") when it raised nothing. A child still running after HANG_GUARD_S is killed and the test fails."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(call, send), daemon=True)
    child.start()
    send.close()  # the child's end only: a child that dies unreported ends the pipe
    try:
        if not receive.poll(HANG_GUARD_S):
            pytest.fail(f"reading the checkpoint hung (still running after {HANG_GUARD_S} s)")
        try:
            return receive.recv()
        except EOFError:
            child.join()
            pytest.fail(f"reading the checkpoint killed its process (exit status {child.exitcode})")
    finally:
        if child.is_alive():
            child.kill()
        child.join()


def refused(call, name: str, problem: str) -> str:
    """call() raises a CheckpointError naming file `name`, saying `problem`, and naming checkpoint-1 to resume
    from instead."""
    kind, message = outcome(call)
    assert kind in ("CheckpointError", "CheckpointMismatchError"), (kind, message)
    assert f"{name}: " in message or f"{name} " in message, message
    assert problem in message, message
    assert "The next-newest complete checkpoint is" in message and message.rstrip(".'").endswith("checkpoint-1"), (
        message
    )
    return message


@pytest.fixture
def checkpoint(tmp_path):
    """checkpoint-2 (empty) beside a complete checkpoint-1."""
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / STATE).write_text("{}")
    (tmp_path / "checkpoint-2").mkdir()
    return tmp_path / "checkpoint-2"


# ---- 1. every JSON file by its shape ------------------------------------------------------------------------


def weights(checkpoint, index):
    save_file({"a": torch.ones(2)}, str(checkpoint / "model-1.safetensors"))
    save_file({"b": torch.zeros(3)}, str(checkpoint / "model-2.safetensors"))
    (checkpoint / INDEX).write_text(index if isinstance(index, str) else json.dumps(index))


def test_a_sharded_model_reads_back_through_its_index(checkpoint):
    weights(
        checkpoint,
        {"metadata": {"total_size": 20}, "weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}},
    )
    saved = files.load_weight_files(str(checkpoint))
    assert torch.equal(saved["a"], torch.ones(2)) and torch.equal(saved["b"], torch.zeros(3))


CRAFTED_INDEXES = {
    "a JSON list": ("[1, 2]", "holds a list, not an object"),
    "a weight_map that is a string": ('{"weight_map": "model-1.safetensors"}', "weight_map is not an object"),
    "no weight_map": ('{"metadata": {}}', "weight_map is not an object"),
    "a file name that is a number": ('{"weight_map": {"a": 5}}', "maps 'a' to 5"),
    "a file name outside the checkpoint": (
        '{"weight_map": {"a": "../checkpoint-1/model-1.safetensors"}}',
        "maps 'a' to '../checkpoint-1/model-1.safetensors'",
    ),
    "an absolute file name": ('{"weight_map": {"a": "/dev/zero"}}', "maps 'a' to '/dev/zero'"),
    "a file that is not safetensors": (
        '{"weight_map": {"a": "trainer_state.json"}}',
        "maps 'a' to 'trainer_state.json'",
    ),
    "unparsable": ('{"weight_map": ', "cannot be read as"),
}


@needs_fork
@pytest.mark.parametrize("case", CRAFTED_INDEXES)
def test_a_crafted_weight_index_is_refused_naming_it(checkpoint, case):
    text, problem = CRAFTED_INDEXES[case]
    weights(checkpoint, text)
    refused(lambda: files.load_weight_files(str(checkpoint)), INDEX, problem)


STATE_BASE = {
    "global_step": 2,
    "micro_step": 2,
    "data_position": 4,
    "num_input_tokens_seen": 10,
    "num_processes": 1,
    "dataset_size": 8,
    "total_flos": 0.0,
    "log_history": [{"step": 1, "epoch": 0.5, "loss": 0.25, "reward": None}],
    "metrics_window": {"reward": [0.5, float("nan")], "total/tokens": [3]},
    "entropy_control": {"entropy_coef": 0.1, "last_world_entropy": None},
    "rollouts": False,
    "an_entry_of_another_version": "kept as it is",
    "save_only_model": False,
    "best_metric": None,
    "best_global_step": None,
    "best_model_checkpoint": None,
    "stateful_callbacks": {
        "EarlyStoppingCallback": {
            "args": {"early_stopping_patience": 2},
            "attributes": {"early_stopping_patience_counter": 0},
        },
        "TwoOfThem": [{"args": {}, "attributes": {}}, {"args": {}, "attributes": None}],
    },
    "config": {"seed": 42},
}


def write_state(checkpoint, **changes):
    state = {**STATE_BASE, **changes}
    (checkpoint / STATE).write_text(json.dumps(state))


def test_a_trainer_state_of_the_right_shape_reads_back(checkpoint):
    write_state(checkpoint)
    state = files.read_state(str(checkpoint), 4, 1)
    assert state["stateful_callbacks"] == STATE_BASE["stateful_callbacks"] and state["log_history"][0]["step"] == 1
    write_state(checkpoint, entropy_control={}, stateful_callbacks=None, dataset_size=None)  # entropy off, a stream
    files.read_state(str(checkpoint), 4, 1)


CRAFTED_STATES = {
    "a log row without a step": (dict(log_history=[{"loss": 1.0}]), "log_history"),
    "a log row holding a list": (dict(log_history=[{"step": 1, "loss": [1.0]}]), "log_history"),
    "a metric too large for a float": (dict(metrics_window={"reward": [10**400]}), "metrics_window"),
    "entropy_control that is a list": (dict(entropy_control=[1, 2]), "entropy_control"),
    "an entropy coefficient that is a string": (dict(entropy_control={"entropy_coef": "0.1"}), "entropy_control"),
    "stateful_callbacks that is a list": (dict(stateful_callbacks=["EarlyStoppingCallback"]), "stateful_callbacks"),
    "a callback's attributes that are a list": (
        dict(stateful_callbacks={"EarlyStoppingCallback": {"args": {}, "attributes": [1]}}),
        "stateful_callbacks",
    ),
    "save_only_model that is a string": (dict(save_only_model="no"), "save_only_model"),
    "rollouts that is a number": (dict(rollouts=1), "rollouts"),
    "num_items that is a string": (dict(num_items="12"), "num_items"),
    "a config that is a list": (dict(config=[]), "config"),
}


@needs_fork
@pytest.mark.parametrize("case", CRAFTED_STATES)
def test_a_crafted_trainer_state_is_refused_naming_it(checkpoint, case):
    changes, problem = CRAFTED_STATES[case]
    write_state(checkpoint, **changes)
    refused(lambda: files.read_state(str(checkpoint), 4, 1), STATE, problem)


# ---- 2. only regular files, within their sizes --------------------------------------------------------------


def fifo(path):
    os.mkfifo(path)


def to_device(device):
    return lambda path: os.symlink(device, path)


SPECIAL = {"a FIFO": (fifo, "is a FIFO"), "/dev/zero": (to_device("/dev/zero"), "/dev/zero, a character device")}
SPECIAL["/dev/urandom"] = (to_device("/dev/urandom"), "/dev/urandom, a character device")


def rng_file(checkpoint):
    torch.save(files.rng_state(), checkpoint / "rng_state_0.pt")


READERS = {
    STATE: lambda c: files.read_state(str(c), 4, 1),
    "optimizer.pt": lambda c: files.load_tensors(str(c / "optimizer.pt"), "optimizer state"),
    "rng_state_0.pt": lambda c: files.load_rng_state(str(c / "rng_state_0.pt")),
    "model.safetensors": lambda c: files.load_weight_files(str(c)),
    INDEX: lambda c: files.load_weight_files(str(c)),
    "model-1.safetensors": lambda c: files.load_weight_files(str(c)),  # named by the index
}


@needs_fork
@pytest.mark.parametrize("special", SPECIAL)
@pytest.mark.parametrize("name", READERS)
def test_a_special_file_is_refused_unopened(checkpoint, name, special):
    make, problem = SPECIAL[special]
    if name == "model-1.safetensors":
        (checkpoint / INDEX).write_text(json.dumps({"weight_map": {"a": name}}))
    make(str(checkpoint / name))
    refused(lambda: READERS[name](checkpoint), name, problem)


PARAMS = {"layer.weight": torch.zeros(3, 2)}


def inflight_files(checkpoint):
    pubs = {1: Publication(0, 1, 1, TrainerState(global_step=1))}
    inflight.write(str(checkpoint), "inflight_0", 2, 2, pubs, {0: {"layer.weight": torch.ones(3, 2)}})


@needs_fork
@pytest.mark.parametrize("special", SPECIAL)
@pytest.mark.parametrize("name", ["inflight_0.json", "inflight_0.tensors"])
def test_a_special_in_flight_file_is_refused_naming_it(checkpoint, name, special):
    inflight_files(checkpoint)
    assert inflight.read(str(checkpoint), "inflight_0", 2, PARAMS, 2) is not None  # as written, it reads back
    make, problem = SPECIAL[special]
    os.remove(checkpoint / name)
    make(str(checkpoint / name))
    refused(lambda: inflight.read(str(checkpoint), "inflight_0", 2, PARAMS, 2), name, problem)


@needs_fork
@pytest.mark.parametrize("special", SPECIAL)
def test_a_special_file_anywhere_in_the_checkpoint_is_refused_naming_it(checkpoint, special):
    """What other libraries read (torch.distributed.checkpoint's shards, DeepSpeed's files, a PEFT adapter) is
    checked before they are handed the directory; a nested file still names checkpoint-1 to resume from."""
    (checkpoint / "sharded").mkdir()
    (checkpoint / "sharded" / ".metadata").write_bytes(b"x")
    (checkpoint / "sharded" / "loop").symlink_to(checkpoint)  # a cycle is walked once, not for ever
    files.check_files(str(checkpoint))
    make, problem = SPECIAL[special]
    make(str(checkpoint / "sharded" / "__0_0.distcp"))
    refused(lambda: files.check_files(str(checkpoint)), "sharded/__0_0.distcp", problem)
    refused(lambda: files.read(str(checkpoint / "sharded"), "sharded state", os.listdir), "__0_0.distcp", problem)


@needs_fork
def test_a_nested_file_names_its_own_checkpoint_to_resume_from_instead(checkpoint):
    (checkpoint / "reference").mkdir()
    os.symlink("/dev/zero", checkpoint / "reference" / "model.safetensors")
    refused(
        lambda: files.read(str(checkpoint / "reference" / "model.safetensors"), "reference model weights", len),
        "reference/model.safetensors",
        "/dev/zero, a character device",
    )


def test_a_symlink_to_a_regular_file_is_read(checkpoint, tmp_path):
    """A checkpoint fetched into a cache (the Hub's snapshots link each file to a blob elsewhere) reads back."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "state").write_text(json.dumps(STATE_BASE))
    os.symlink(tmp_path / "blobs" / "state", checkpoint / STATE)
    assert files.read_state(str(checkpoint), 4, 1)["global_step"] == 2
    files.check_files(str(checkpoint))


@needs_fork
def test_a_json_file_past_its_size_limit_is_refused_unread(checkpoint):
    """A sparse trainer_state.json past JSON_LIMIT (an archive can hold one in a few bytes) is refused by its size."""
    with open(checkpoint / STATE, "wb") as f:
        f.truncate(files.JSON_LIMIT + 1)
    refused(lambda: files.read_state(str(checkpoint), 4, 1), STATE, "bytes, more than")


@needs_fork
def test_a_compressed_torch_file_is_refused_unexpanded(checkpoint, tmp_path):
    """torch.save stores its entries uncompressed; a deflated entry could expand far past the file (a zip bomb)."""
    torch.save({"w": torch.zeros(1000)}, tmp_path / "plain.pt")
    with zipfile.ZipFile(tmp_path / "plain.pt") as plain, zipfile.ZipFile(checkpoint / "optimizer.pt", "w") as out:
        for entry in plain.infolist():
            out.writestr(entry.filename, plain.read(entry.filename), compress_type=zipfile.ZIP_DEFLATED)
    assert torch.load(checkpoint / "optimizer.pt", weights_only=True)["w"].shape == (1000,)  # torch would expand it
    refused(
        lambda: files.load_tensors(str(checkpoint / "optimizer.pt"), "optimizer state"), "optimizer.pt", "compressed"
    )
    assert files.load_tensors(str(tmp_path / "plain.pt"), "state")["w"].shape == (1000,)
