"""The wire of grpo's `gloo` weight-transfer engine (`grpo.serve.gloo`), both of its transports: shared memory on
one host (a ring every rank maps) and TCP broadcasts (across hosts, or `GRPO_WEIGHTS_TRANSPORT=tcp`).

- Every tensor arrives whole, in its wire dtype, bit for bit what the sender's cast makes, whatever its dtype or
  size: packed, direct, in pieces, over several slots; to one receiver or two (a server in two shards).
- One host is detected so that nothing can fool it: rank 0's segment (a random name, only its user may open it,
  a nonce inside, the kernel's boot id beside), and a receiver that cannot map it (another container's /dev/shm,
  another user, another kernel) or a side that asks for TCP makes the whole link TCP, never an error.
- Nothing is left in /dev/shm once the ranks have connected, nor after a crash of either side or a timeout; a
  killed or stalled peer is an error after the group's timeout, never a hang.
- What is sent is checked against what the receivers were told, before it is sent."""

from __future__ import annotations

import concurrent.futures
import errno
import json
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from grpo.serve import gloo, messages, segment

SRC = str(Path(gloo.__file__).resolve().parents[2])  # this checkout's src/: the subprocesses import the same grpo
SHM_DIR = segment.SHM_DIR
# where this test process looks for free ports: pytest-xdist's workers (gw0, gw1, ...) each from a range of their own,
# so that two workers' groups never race for one port between the probe and the bind
PORTS = 40000 + 2000 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)


@pytest.fixture(autouse=True)
def small_limits(monkeypatch):
    """Limits of a few KB: packs, direct tensors, pieces and a ring of small slots on small tensors."""
    monkeypatch.setattr(messages, "DIRECT_BYTES", 4000)
    monkeypatch.setattr(messages, "PACK_BYTES", 3000)
    monkeypatch.setattr(messages, "MAX_MESSAGE_BYTES", 8000)
    monkeypatch.setattr(gloo, "IN_FLIGHT_BYTES", 10000)
    monkeypatch.setattr(segment, "SLOT_BYTES", 1024)
    monkeypatch.setattr(segment, "SLOTS", 3)
    monkeypatch.setattr(segment, "MIN_SLOT_BYTES", 256)
    monkeypatch.delenv(gloo.TRANSPORT_ENV, raising=False)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(300, 40, generator=g),  # direct, in pieces of MAX_MESSAGE_BYTES; over many slots
        "norm": torch.randn(40, generator=g),
        "scalar": torch.tensor(3.0),
        "ids": torch.arange(7),  # not floating-point: its own dtype
        "empty": torch.zeros(0, 5),
        "strided": torch.randn(50, 30, generator=g).t(),  # not contiguous
        "bias": torch.randn(1000, generator=g),  # fills a pack buffer past PACK_BYTES
        "last": torch.randn(3, generator=g),
    }


def _many_tensors(seed: int = 1):
    """Tensors of every kind of dtype (floating, integer, bool, complex) and of sizes around the alignment (16
    bytes) and the limits, with floats' special values (NaN, infinities, -0, subnormals)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16]
    dtypes += [torch.int8, torch.uint8, torch.bool, torch.complex64]
    sizes = [0, 1, 3, 7, 8, 9, 15, 16, 17, 100, 255, 256, 257, 1000, 1500, 3000]
    tensors = {}
    for i in range(60):
        dtype, size = rng.choice(dtypes), rng.choice(sizes)
        if dtype.is_floating_point or dtype.is_complex:
            t = torch.randn(size, generator=g).to(dtype)
            if dtype.is_floating_point and size >= 5:
                t[:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40]).to(dtype)
        elif dtype == torch.bool:
            t = torch.rand(size, generator=g) > 0.5
        else:
            t = torch.randint(0, 100, (size,), generator=g).to(dtype)
        if size == 1000:
            t = t.reshape(25, 40).t()  # not contiguous
        tensors[f"t{i}"] = t
    tensors["big"] = torch.randn(3, 2000, generator=g)  # 24 KB: many slots, many pieces
    return tensors


def _meta(tensors, dtype):
    return [(n, dtype if t.is_floating_point() else t.dtype, tuple(t.shape)) for n, t in tensors.items()]


def _bits(tensor):
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(got, expected) -> bool:
    """The same dtype, shape and bits, but for NaNs' payloads (torch's casts give a NaN other payloads on strided
    and contiguous tensors): NaN where NaN, every other value bit for bit (-0 is not 0)."""
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return False
    if got.is_floating_point():
        nan = got.isnan()
        if not torch.equal(nan, expected.isnan()):
            return False
        got, expected = got.masked_fill(nan, 0), expected.masked_fill(nan, 0)
    return torch.equal(_bits(got), _bits(expected))


def _expected(tensor, dtype):
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _leftovers(pid: int | None = None) -> list[str]:
    """The segments of process `pid` (default: this one) still named in /dev/shm."""
    prefix = f"grpo-weights-{pid or os.getpid()}-"
    return [name for name in os.listdir(SHM_DIR) if name.startswith(prefix)]


def _push(pairs, metadata, transports=("auto", "auto"), keep=True, links=None):
    """Rank 0 (this thread) sends `pairs` to the other ranks (threads named rank1, rank2, ...; one per entry of
    `transports` after the first, each rank's transport setting): (what each receiver got, how many loads each
    had, each rank's transport)."""
    port = gloo.free_port(PORTS + 1000)
    world = len(transports)
    received = [{} for _ in range(world)]
    loads = [0] * world
    used = [""] * world
    errors = []

    def receiver(rank):
        def load(done):
            loads[rank] += 1
            received[rank].update((n, t.clone() if not keep else t) for n, t in done)

        try:
            link = gloo.connect("127.0.0.1", port, rank, world, "test", 30, transport=transports[rank])
            used[rank] = link.transport
            gloo.receive(link, metadata, load, keep=keep)
            link.shutdown()
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=receiver, args=(r,), name=f"rank{r}") for r in range(1, world)]
    for thread in threads:
        thread.start()
    link = gloo.connect("127.0.0.1", port, 0, world, "test", 30, transport=transports[0])
    used[0] = link.transport
    assert _leftovers() == []  # gone as soon as every rank has it mapped
    try:
        gloo.send(link, pairs, metadata)
    finally:
        for thread in threads:
            thread.join(30)
        link.shutdown()
    assert not errors, errors
    assert _leftovers() == []
    return received[1:], loads[1:], used


@pytest.mark.parametrize("receivers", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_every_tensor_arrives_whole_bit_for_bit(transport, dtype, receivers):
    sent = {**_tensors(), **_many_tensors()}
    metadata = _meta(sent, dtype)
    kinds = {(m.direct, len(m.parts)) for m in messages.plan(metadata)}
    assert (True, 1) in kinds and any(not direct and parts > 1 for direct, parts in kinds)
    received, loads, used = _push(sent.items(), metadata, (transport,) * (1 + receivers))
    assert used == ["shared memory" if transport == "auto" else "TCP"] * (1 + receivers)
    for got, count in zip(received, loads):
        assert count > 1 and set(got) == set(sent)
        for name, tensor in sent.items():
            expected = _expected(tensor, dtype)
            assert _same(got[name], expected), name


def test_both_transports_hand_on_the_same_bits():
    sent = _many_tensors(seed=2)
    metadata = _meta(sent, torch.bfloat16)
    through_ring, _, used = _push(sent.items(), metadata, ("auto", "auto"))
    over_tcp, _, used_tcp = _push(sent.items(), metadata, ("tcp", "tcp"))
    assert used == ["shared memory"] * 2 and used_tcp == ["TCP"] * 2
    for name in sent:
        assert _same(through_ring[0][name], over_tcp[0][name]), name


def test_views_of_the_ring_are_valid_while_load_runs():
    """keep=False: tensors whole in a slot are views of it (this load copies them); they come out right."""
    sent = _many_tensors(seed=3)
    metadata = _meta(sent, torch.float32)
    received, _, used = _push(sent.items(), metadata, keep=False)
    assert used == ["shared memory"] * 2
    for name, tensor in sent.items():
        assert _same(received[0][name], _expected(tensor, torch.float32)), name


def test_the_stream_covers_every_byte_once_within_the_slots():
    metadata = _meta(_many_tensors(seed=4), torch.bfloat16)
    slot = 512
    chunks = gloo.stream_plan(metadata, slot)
    covered: dict[int, list[tuple[int, int]]] = {}
    for chunk in chunks:
        assert 0 < chunk.size <= slot or all(n == 0 for *_, n in chunk.parts)
        for index, start, offset, length in chunk.parts:
            assert offset % segment.ALIGN == 0 or start > 0  # a tensor starts aligned; a piece starts a slot
            assert offset + length <= slot and offset % metadata[index][1].itemsize == 0
            covered.setdefault(index, []).append((start, length))
    assert sorted(covered) == list(range(len(metadata)))
    for index, pieces in covered.items():
        position = 0
        for start, length in pieces:
            assert start == position
            position += length
        assert position == messages.nbytes(metadata[index])
    with pytest.raises(ValueError, match="multiple of 16"):
        gloo.stream_plan(metadata, 1000)


# ---- one host, detected ----------------------------------------------------------------------------------------------


def _in_thread(rank_name: str, then, otherwise):
    """A stand-in that behaves as `then` on the thread named `rank_name`, as `otherwise` elsewhere."""
    return lambda *args: (then if threading.current_thread().name == rank_name else otherwise)(*args)


@pytest.mark.parametrize(
    "cause",
    ["tcp on rank 0", "tcp on a receiver", "no /dev/shm on rank 0", "a receiver cannot open it", "another kernel"],
)
def test_any_rank_that_cannot_share_memory_makes_the_link_tcp(monkeypatch, tmp_path, cause):
    """Two receivers, one of them (rank 2) on its own (another container, another user, another host): every rank
    goes over TCP, and the tensors arrive right."""
    transports = ["auto", "auto", "auto"]
    if cause == "tcp on rank 0":
        transports[0] = "tcp"
    elif cause == "tcp on a receiver":
        transports[2] = "tcp"
    elif cause == "no /dev/shm on rank 0":
        monkeypatch.setattr(segment, "SHM_DIR", str(tmp_path / "missing"))
    elif cause == "a receiver cannot open it":
        monkeypatch.setattr(segment, "open_offered", _in_thread("rank2", lambda offer: None, segment.open_offered))
    else:
        monkeypatch.setattr(segment, "boot_id", _in_thread("rank2", lambda: "another-kernel", segment.boot_id))
    sent = _tensors()
    metadata = _meta(sent, torch.bfloat16)
    received, _, used = _push(sent.items(), metadata, tuple(transports))
    assert used == ["TCP"] * 3
    for got in received:
        for name, tensor in sent.items():
            assert _same(got[name], _expected(tensor, torch.bfloat16)), name


def test_another_file_of_the_same_name_is_not_taken_for_the_segment(monkeypatch):
    """A receiver that opens a file of the offered name but another nonce (another /dev/shm that happens to hold
    one) does not use it."""
    opened, open_segment = [], segment.open_offered

    def elsewhere(offer):
        opened.append(offer["name"])
        return open_segment({**offer, "nonce": "00" * 16})

    monkeypatch.setattr(segment, "open_offered", elsewhere)
    sent = _tensors()
    _, _, used = _push(sent.items(), _meta(sent, torch.float32))
    assert opened and used == ["TCP"] * 2


def test_an_offer_a_receiver_cannot_read_is_a_refusal_not_an_error():
    good = dict(name=f"grpo-weights-1-{'0' * 32}", nonce="00" * 16, boot=segment.boot_id(), slots=2, slot_bytes=1024)
    for bad in (
        {},
        {"name": "../../etc/passwd"},
        {"name": "/dev/shm/x"},
        {"slot_bytes": 0},
        {"slot_bytes": 1000},
        {"slots": "x"},
        {"nonce": "zz"},
        {"boot": "another"},
        {"name": None},
    ):
        assert segment.open_offered({**good, **bad} if bad else bad) is None, bad
    assert segment.open_offered(good) is None  # no such segment
    assert segment.path_of("../../etc/passwd") is None


def test_a_full_dev_shm_gets_a_smaller_ring_or_tcp(monkeypatch):
    room = {"bytes": 3 * 512}
    fallocate = os.posix_fallocate

    def limited(fd, offset, length):
        if length > room["bytes"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", limited)
    port = gloo.free_port(PORTS + 1000)
    rings = []

    def receiver():
        link = gloo.connect("127.0.0.1", port, 1, 2, "test", 30)
        rings.append(link.ring and link.ring.slot_bytes)
        link.shutdown()

    for expected in (512, None):  # 3 slots of 512 bytes fit; then nothing does (under _MIN_SLOT_BYTES)
        thread = threading.Thread(target=receiver)
        thread.start()
        link = gloo.connect("127.0.0.1", port, 0, 2, "test", 30)
        thread.join(30)
        assert (link.ring and link.ring.slot_bytes) == expected and rings[-1] == expected
        link.shutdown()
        room["bytes"] = 3 * 128
        port = gloo.free_port(port + 1)
    assert _leftovers() == []


def test_a_ring_closed_while_a_slot_is_in_use_stays_mapped_until_it_is_done():
    """A link shut down while its send still runs (the server's error came first): the slot the sending thread
    writes stays mapped (no crash), and the mapping goes with the last view."""
    memory = mmap.mmap(-1, 4096)
    ring = segment.Ring(memory, 2, 2048)
    slot = ring.slot(1)
    ring.close()
    assert not memory.closed
    slot.fill_(7)
    assert memory[2048] == 7 and memory[0] == 0
    del slot
    ring.close()
    assert memory.closed


def test_the_transport_setting_is_checked(monkeypatch):
    monkeypatch.setenv(gloo.TRANSPORT_ENV, "TCP")
    assert gloo.transport_setting() == "tcp"
    monkeypatch.setenv(gloo.TRANSPORT_ENV, "shm")
    with pytest.raises(ValueError, match="GRPO_WEIGHTS_TRANSPORT='shm': one of auto, tcp"):
        gloo.connect("127.0.0.1", 1, 0, 2, "test", 1)  # before anything is opened


def test_tensors_other_than_announced_are_an_error_before_they_are_sent():
    sent = _tensors()
    metadata = _meta(sent, torch.float32)
    renamed = [("other" if n == "embed" else n, t) for n, t in sent.items()]
    reshaped = [(n, t.reshape(-1) if n == "embed" else t) for n, t in sent.items()]
    ring = segment.Ring(mmap.mmap(-1, 2048), 2, 1024)
    for link in (gloo.Link(None), gloo.Link(None, ring=ring)):  # no group: nothing was sent
        with pytest.raises(ValueError, match="tensor 0 is other .* receivers were told embed"):
            gloo.send(link, renamed, metadata)
        with pytest.raises(ValueError, match=r"tensor 0 is embed \(12000,\)"):
            gloo.send(link, reshaped, metadata)
    assert gloo.free_port(gloo.free_port(PORTS)) >= PORTS


# ---- other processes: other containers and users, crashes, timeouts -------------------------------------------------

PEER = r"""
import json, os, signal, sys, time
import torch
from grpo.serve import gloo, messages, segment
role, port, transport, metadata, die, timeout = sys.argv[1:]
port, metadata, timeout = int(port), json.loads(metadata), float(timeout)
messages.DIRECT_BYTES, messages.PACK_BYTES, messages.MAX_MESSAGE_BYTES = 4000, 3000, 8000
gloo.IN_FLIGHT_BYTES = 10000
segment.SLOT_BYTES, segment.SLOTS, segment.MIN_SLOT_BYTES = 1024, 3, 256  # the limits of `small_limits`
metadata = [(n, getattr(torch, d), tuple(s)) for n, d, s in metadata]
if die == "in the handshake":
    segment.open_offered = lambda offer: os.kill(os.getpid(), signal.SIGKILL)
link = gloo.connect("127.0.0.1", port, 0 if role == "send" else 1, 2, "test", timeout, transport=transport)
print(json.dumps({"transport": link.transport, "pid": os.getpid()}), flush=True)
if die == "stalls":
    time.sleep(60)
if role == "send":
    def pairs():
        for i, (name, dtype, shape) in enumerate(metadata):
            if die == "midway" and i == len(metadata) // 2:
                os.kill(os.getpid(), signal.SIGKILL)
            yield name, torch.full(shape, i, dtype=dtype)
    gloo.send(link, pairs(), metadata)
else:
    got = {}
    def load(done):
        if die == "midway":
            os.kill(os.getpid(), signal.SIGKILL)
        got.update((n, t.float().sum().item()) for n, t in done)
    gloo.receive(link, metadata, load)
    print(json.dumps(got), flush=True)
link.shutdown()
"""


def _peer(role, port, metadata, transport="auto", die="", prefix=(), timeout=30):
    meta = [(n, str(d).removeprefix("torch."), list(s)) for n, d, s in metadata]
    command = [*prefix, sys.executable, "-c", PEER, role, str(port), transport, json.dumps(meta), die or "-"]
    command.append(str(timeout))
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _filled(metadata):
    return [(n, torch.full(s, i, dtype=d)) for i, (n, d, s) in enumerate(metadata)]


def _receiver_elsewhere(prefix):
    """A receiver in another process, started under `prefix`: (its transport, the sums it received)."""
    metadata = _meta(_tensors(), torch.float32)
    port = gloo.free_port(PORTS + 1500)
    peer = _peer("receive", port, metadata, prefix=prefix)
    try:
        link = gloo.connect("127.0.0.1", port, 0, 2, "test", 30)
        try:
            gloo.send(link, _filled(metadata), metadata)
        except RuntimeError as e:  # the receiver failed: its own error says why
            out, err = peer.communicate(timeout=60)
            raise AssertionError(f"the receiver failed ({e}):\n{err}") from e
        out, err = peer.communicate(timeout=60)
    finally:
        peer.kill()
    assert peer.returncode == 0, err
    first, second = out.splitlines()[:2]
    transport = link.transport
    assert transport == json.loads(first)["transport"]
    link.shutdown()
    assert _leftovers() == []
    return transport, json.loads(second)


def test_a_receiver_in_another_process_on_this_host_shares_memory():
    transport, sums = _receiver_elsewhere(())
    metadata = _meta(_tensors(), torch.float32)
    assert transport == "shared memory"
    assert sums == {n: float(torch.full(s, i, dtype=d).float().sum()) for i, (n, d, s) in enumerate(metadata)}


def _can(command) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not shutil.which("unshare"), reason="needs unshare")
def test_a_receiver_with_its_own_dev_shm_another_container_goes_over_tcp():
    """A receiver in a mount namespace of its own with a tmpfs of its own on /dev/shm (a container without
    --ipc=host on the same host): the segment is not there, the link is TCP."""
    prefix = [
        "unshare",
        "--mount",
        "--user",
        "--map-root-user",
        "sh",
        "-c",
        'mount -t tmpfs none /dev/shm && "$@"',
        "-",
    ]
    if not _can([*prefix, "true"]):
        pytest.skip("cannot make a mount namespace with a /dev/shm of its own here")
    transport, sums = _receiver_elsewhere(prefix)
    assert transport == "TCP" and len(sums) == len(_tensors())


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root (to run as another user)")
def test_a_receiver_of_another_user_goes_over_tcp():
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if not _can([*prefix, sys.executable, "-c", f"import sys; sys.path.insert(0, {SRC!r}); import grpo.serve.gloo"]):
        pytest.skip("the other user cannot run this checkout's Python")
    transport, sums = _receiver_elsewhere(prefix)
    assert transport == "TCP" and len(sums) == len(_tensors())


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("who", ["receiver", "sender"])
def test_a_peer_killed_midway_is_an_error_in_seconds_and_leaves_nothing(transport, who):
    metadata = _meta({f"w{i}": torch.zeros(100, 10) for i in range(8)}, torch.float32)  # 4 KB each
    port = gloo.free_port(PORTS + 1500)
    peer = _peer("receive" if who == "receiver" else "send", port, metadata, transport, die="midway")
    try:
        link = gloo.connect("127.0.0.1", port, 1 if who == "sender" else 0, 2, "test", 10, transport=transport)
        assert link.transport == ("shared memory" if transport == "auto" else "TCP")
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            if who == "receiver":
                gloo.send(link, _filled(metadata), metadata)
            else:
                gloo.receive(link, metadata, lambda done: None)
        assert time.monotonic() - start < 15  # the group's timeout (10 s) at most, never a hang
        assert peer.wait(30) == -signal.SIGKILL
        link.shutdown()
    finally:
        peer.kill()
    assert _leftovers() == [] and _leftovers(peer.pid) == []


@pytest.mark.parametrize("who", ["receiver", "sender"])
def test_a_stalled_peer_is_an_error_after_the_timeout(who):
    metadata = _meta({f"w{i}": torch.zeros(100, 10) for i in range(8)}, torch.float32)
    port = gloo.free_port(PORTS + 1500)
    timeout = 8  # room for the peer's start (importing torch) on a busy machine
    peer = _peer("receive" if who == "receiver" else "send", port, metadata, die="stalls", timeout=timeout)
    try:
        link = gloo.connect("127.0.0.1", port, 1 if who == "sender" else 0, 2, "test", timeout)
        assert link.transport == "shared memory"
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="(?i)timed? ?out"):
            if who == "receiver":
                gloo.send(link, _filled(metadata), metadata)
            else:
                gloo.receive(link, metadata, lambda done: None)
        assert timeout - 1 < time.monotonic() - start < timeout + 10
        link.shutdown()
    finally:
        peer.kill()
    assert _leftovers() == [] and _leftovers(peer.pid) == []


def test_a_receiver_killed_in_the_handshake_leaves_nothing():
    """Rank 0's segment is named while the receivers open it: a receiver killed then fails rank 0's connect (the
    group's error, in seconds), and the name is gone."""
    metadata = _meta(_tensors(), torch.float32)
    port = gloo.free_port(PORTS + 1500)
    peer = _peer("receive", port, metadata, die="in the handshake")
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            gloo.connect("127.0.0.1", port, 0, 2, "test", 10)
        assert time.monotonic() - start < 30
    finally:
        peer.kill()
    assert _leftovers() == []


def test_a_connection_given_up_ends_at_once_and_one_nobody_joins_times_out():
    """Rank 0 waits for its receivers in short polls: a caller that gives the connection up (its server answered
    with an error) gets an error within a poll, not after the timeout, so no thread is left waiting in torch's store
    (one that woke at its timeout while the interpreter shut down aborted the process); nobody joining is an error
    after the timeout that counts who came."""
    cancelled = threading.Event()
    threading.Timer(0.3, cancelled.set).start()
    start = time.monotonic()
    with pytest.raises(gloo.JoinError, match="given up"):
        gloo.connect("127.0.0.1", gloo.free_port(PORTS + 1500), 0, 3, "test", 60, cancelled=cancelled)
    assert time.monotonic() - start < 5
    with pytest.raises(gloo.JoinError, match="timed out after 1 s: 0 of the 2 receivers joined"):
        gloo.connect("127.0.0.1", gloo.free_port(PORTS + 1500), 0, 3, "test", 1)


def test_the_server_s_error_cancels_the_work_it_races():
    from grpo.serve.vllm_plugin import _racing

    answered: concurrent.futures.Future = concurrent.futures.Future()
    answered.set_exception(RuntimeError("the server refused"))
    seen = []

    def work(cancelled):
        seen.append(cancelled.wait(30))
        return "late"

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the server refused"):
        _racing(answered, work)
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [True] and time.monotonic() - start < 5
