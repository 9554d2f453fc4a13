"""Test jobs forked from one process that has imported torch, transformers, datasets, accelerate and grpo already.

A fresh interpreter spends ~4.6 s importing those before a job's first line, and the tests start well over a hundred
job processes (runs killed and resumed, several processes under torch.distributed); a job's own work on the tiny
model is a second or two. So this module keeps one such process (the zygote, started on first use, one per test
session) and forks each job from it: the job's script runs as `__main__` with its own argv, environment, working
directory and standard streams, in a process of its own that the test signals, kills and waits for by pid, as a
subprocess. What a forked job shares with the zygote is what every fresh interpreter computes at import; the
generators that a fresh interpreter seeds from the OS (`random`, numpy's) are seeded again in each job, and torch's
thread count follows the job's `OMP_NUM_THREADS` as it would at start-up.

The few environment variables that the preloaded libraries read when imported (`IMPORT_TIME`) must be the zygote's:
a job given other values is refused (`fork` raises), and such a test starts a fresh interpreter. Tests whose
subject is the launcher itself (torchrun's signal forwarding, the `grpo` command under torchrun) keep starting real
ones.

Why not the standard library's forkserver (`multiprocessing.get_context("forkserver")` with
`set_forkserver_preload` and `runpy` in the target), which would fork from a preloaded process at the same cost: a
multiprocessing child ends with `os._exit`, so its `atexit` handlers never run (checked on Python 3.11: a handler a
forkserver child registers does not run when the target returns). grpo tears a run's process group down from one
(`grpo.distributed.accelerator.end_training`), as torch and accelerate do from theirs, and the distributed jobs forked
here are the tests of that exit; a job here returns from `runpy` into a normal interpreter exit, as `python JOB` does.

    python tests/support/zygote.py SOCKET    # the zygote (what `fork` starts)
"""

from __future__ import annotations

import array
import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

# environment variables the preloaded libraries read at import: a job must see the zygote's values
# (the hub's and datasets' settings, the caches, the interpreter's and the BLAS libraries' own)
IMPORT_TIME = (
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_CACHE",
    "TRANSFORMERS_OFFLINE",
    "PYTHON",
    "OPENBLAS_",
    "MKL_",
    "TORCH_HOME",
    "XDG_CACHE_HOME",
)


# ---- the zygote --------------------------------------------------------------------------------------------------


def _preload() -> int:
    """Imports what every job imports; returns torch's thread count for a job without OMP_NUM_THREADS."""
    import accelerate  # noqa: F401
    import datasets  # noqa: F401
    import numpy  # noqa: F401
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch
    import torch.distributed  # noqa: F401
    import transformers  # noqa: F401

    import grpo  # noqa: F401
    import grpo.async_trainer  # noqa: F401
    import grpo.trainer  # noqa: F401

    return torch.get_num_threads()  # OpenMP's default, read without starting its threads (a fork would lose them)


def _serve(path: str) -> tuple[list[str], dict[str, str], str, int]:
    """Forks a job for each request on the socket at `path`, until the test session (the parent) ends; returns
    only in a forked job, with its argv, environment, working directory and thread count."""
    threads = _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    os.rename(path + ".new", path)  # the socket appears ready to accept
    listener.listen(64)
    parent = os.getppid()
    jobs: dict[int, socket.socket] = {}  # each running job's pid: the connection its status goes back on
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, *jobs.values()], [], [], 0.01)
        for sock in ready:
            if sock is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, EOFError, ValueError):  # a test that died mid-request: the others go on
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:  # the job
                    listener.close()
                    for other in [conn, *jobs.values()]:
                        other.close()
                    for target, fd in enumerate(fds):
                        os.dup2(fd, target)
                        os.close(fd)
                    return request["argv"], request["env"], request["cwd"], threads
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                jobs[pid] = conn
            else:  # a test hung up on a job it no longer waits for (its session ended): the job goes with it
                pid = next(p for p, c in jobs.items() if c is sock)
                if not sock.recv(1):
                    _kill(pid)
        for pid, conn in list(jobs.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)  # -N when killed by signal N, as subprocess reports it
                try:
                    conn.sendall(f"{code}\n".encode())
                except OSError:
                    pass
                conn.close()
                del jobs[pid]
    for pid in jobs:
        _kill(pid)
    sys.exit(0)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data = b""
    while not data.endswith(b"\n"):
        chunk, ancillary, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * fds.itemsize))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        if not chunk:
            raise EOFError("the test hung up before its request was whole")
        data += chunk
    return json.loads(data), list(fds)


def _become(argv: list[str], env: dict[str, str], cwd: str, threads: int) -> None:
    """This forked process becomes the job: `argv[0]` run as `__main__` (its exit, exception or SystemExit, is the
    process's, as for `python argv[0] ...`)."""
    import random
    import runpy

    import numpy
    import torch

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    random.seed()
    numpy.random.seed()
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or threads))
    runpy.run_path(argv[0], run_name="__main__")


# ---- the tests' side ---------------------------------------------------------------------------------------------

_zygote: dict[str, object] = {}
_lock = threading.Lock()


def _address() -> str:
    """The zygote's socket, starting it on first use (it ends with this process)."""
    with _lock:
        if "path" not in _zygote:
            folder = tempfile.mkdtemp(prefix="grpo-zygote-")
            path = os.path.join(folder, "socket")
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
            log = open(os.path.join(folder, "log"), "w")
            proc = subprocess.Popen([sys.executable, __file__, path], env=env, stdout=log, stderr=log)
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            atexit.register(proc.wait)
            atexit.register(proc.kill)
            while not os.path.exists(path):
                if proc.poll() is not None:
                    raise RuntimeError(f"the zygote exited with {proc.returncode}:\n{open(log.name).read()[-3000:]}")
                time.sleep(0.01)
            _zygote.update(path=path, proc=proc, env=env, log=log.name)
        return str(_zygote["path"])


class Job:
    """A job forked by the zygote, waited for as a subprocess: `pid`, `returncode` (-N when killed by signal N),
    `poll`, `wait`, `send_signal`, `kill`."""

    def __init__(self, pid: int, conn: socket.socket):
        self.pid, self._conn, self.returncode = pid, conn, None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._finish()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"job {self.pid}", timeout)
            self._finish()
        return self.returncode

    def _finish(self) -> None:
        status = _line(self._conn)
        self._conn.close()
        self.returncode = int(status)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            raise RuntimeError(f"the zygote ended while a job ran; its log: {_zygote.get('log')}")
        data += chunk
    return data.decode().strip()


def fork(argv: list[str], env: dict[str, str] | None = None, stdout=None, stderr=None, cwd: str | None = None) -> Job:
    """Runs `python argv...` as a process forked from the zygote. `stdout` / `stderr`: a file object or descriptor
    to write to, or `subprocess.DEVNULL` (the default: this process's own); the job reads nothing. `env`: its
    whole environment (default: this process's)."""
    path = _address()
    env = dict(os.environ if env is None else env)
    kept = _zygote["env"]
    assert isinstance(kept, dict)
    for name in set(env) | set(kept):
        if name.startswith(IMPORT_TIME) and name != "PYTHONPATH" and env.get(name) != kept.get(name):
            raise ValueError(f"{name} is read when the zygote imports, as {kept.get(name)!r}: run this job fresh")
    fds = []
    with open(os.devnull, "r+") as null:
        for stream, own in ((null, 0), (stdout, 1), (stderr, 2)):
            stream = own if stream is None else null if stream == subprocess.DEVNULL else stream
            fds.append(stream if isinstance(stream, int) else stream.fileno())
        request = json.dumps({"argv": list(map(str, argv)), "env": env, "cwd": cwd or os.getcwd()}) + "\n"
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        socket.send_fds(conn, [request.encode()], fds)
    return Job(int(_line(conn)), conn)


if __name__ == "__main__":
    _become(*_serve(sys.argv[1]))
