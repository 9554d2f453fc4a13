"""Tests of several processes: the launcher of torchrun's workers (forked from the session's zygote), job scripts
(`jobs/`, `job_script`) and their environment, free ports, and `ahead` and `side_by_side`, which run the processes
of several tests or calls two at a time."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from support import zygote

JOBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs")
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed not installed")


def job_script(name: str) -> str:
    """The path of job script `name` (tests/support/jobs/): run as `python PATH`, forked by the zygote or under
    torchrun; it imports `support.*` from tests/, which `job_env` puts on its PYTHONPATH."""
    return os.path.join(JOBS, name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(**extra) -> dict[str, str]:
    """The environment of a job process the tests start: this one's, its import path, one thread, and `extra`."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1", **extra)


def torchrun_command(nproc) -> list[str]:
    """torchrun itself (`python -m torch.distributed.run`) for nproc processes on a free port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
    ]


class Workers:
    """`script args` in nproc processes forked from the session's zygote (`zygote.fork`: the imports done once),
    each with the environment torchrun gives its workers (gloo on CPU, one thread each), its output in a log of its
    own. Whatever still runs when the `with` block ends is killed."""

    def __init__(self, nproc, script, *args, **env):
        self._logs = tempfile.TemporaryDirectory(prefix="workers-")
        self.files, self.jobs = [], []
        port = free_port()
        for rank in range(nproc):
            self.files.append(open(os.path.join(self._logs.name, f"rank{rank}.log"), "w+"))
            worker = job_env(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                ROLE_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                ROLE_WORLD_SIZE=str(nproc),
                GROUP_RANK="0",
                GROUP_WORLD_SIZE="1",
                ROLE_NAME="default",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                TORCHELASTIC_RESTART_COUNT="0",
                TORCHELASTIC_MAX_RESTARTS="0",
                TORCHELASTIC_RUN_ID="none",
                **env,
            )
            argv = [script, *map(str, args)]
            self.jobs.append(zygote.fork(argv, env=worker, stdout=self.files[-1], stderr=self.files[-1]))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for job in self.jobs:
            job.kill()
            job.wait(60)
        for f in self.files:
            f.close()
        self._logs.cleanup()

    def wait(self, timeout, first_failure_ends_all=True) -> list[int | None]:
        """The exit statuses once all have ended, or at `timeout` s (None for those still running); as torchrun,
        the first to fail ends the wait."""
        deadline = time.monotonic() + timeout
        codes = [job.poll() for job in self.jobs]
        while None in codes and (set(codes) <= {None, 0} or not first_failure_ends_all):
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
            codes = [job.poll() for job in self.jobs]
        return codes

    def log(self, rank) -> str:
        self.files[rank].seek(0)
        return self.files[rank].read()

    def logs(self, codes) -> str:
        return "\n".join(f"---- rank {r} exited with {c}:\n{self.log(r)[-3000:]}" for r, c in enumerate(codes))


def torchrun(nproc, script, *args, timeout=240, fresh=False):
    """`script args` in nproc processes under torch.distributed (gloo on CPU, one thread each); asserts they all
    succeeded. The processes are torchrun's workers as `Workers` forks them; with `fresh`, torchrun itself starts
    them (`python -m torch.distributed.run`), for tests of a launch as users run it (`script` may then be `-m`)."""
    if fresh:
        cmd = [*torchrun_command(nproc), script, *map(str, args)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=job_env(), timeout=timeout)
        assert done.returncode == 0, done.stderr[-4000:]
        return
    with Workers(nproc, script, *args) as workers:
        codes = workers.wait(timeout)
        assert codes == [0] * nproc, workers.logs(codes)


def terminated(script, out, *args, ready, delay, fresh=False, **env):
    """`script out args` in 2 processes, sent SIGTERM `delay` s after file `ready` appears in `out`: both processes
    exit 143 within seconds, none killed (30 s after SIGTERM). The processes are forked (`Workers`), and the test
    sends SIGTERM to both, as torchrun passes it on; with `fresh`, torchrun starts them and gets the SIGTERM (it kills
    a process still running 30 s later). `env`: more environment variables for the job."""
    if not fresh:
        with Workers(2, script, out, *args, **env) as workers:
            while not (out / ready).exists() and None in [job.poll() for job in workers.jobs]:
                time.sleep(0.01)
            time.sleep(delay)
            for job in workers.jobs:
                job.send_signal(signal.SIGTERM)
            codes = workers.wait(30, first_failure_ends_all=False)
            assert codes == [143, 143], workers.logs(codes)
            assert all("exiting with status 143" in workers.log(rank) for rank in (0, 1)), workers.logs(codes)
        return
    cmd = [*torchrun_command(2), script, str(out), *args]
    proc = subprocess.Popen(cmd, env=job_env(**env), stderr=subprocess.PIPE, text=True)
    while not (out / ready).exists() and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert stderr.count("exiting with status 143") == 2, stderr[-3000:]
    assert "Unable to shutdown process" not in stderr


def launch(nproc, out, model_dir, loss_type, *mode):
    torchrun(nproc, job_script("distributed_job.py"), out, model_dir, loss_type, *mode)
    with open(os.path.join(out, "row.json")) as f:
        return torch.load(os.path.join(out, "update.pt")), json.load(f)


def launch_runs(nproc, out, model_dir, runs):
    """Several replicated runs, `runs` as (loss_type, mode), one after another in one launch of nproc processes (a
    trainer each): {(loss_type, mode): (update, logged row)}, as `launch` would give each."""
    specs = [f"{loss_type}:{mode}" for loss_type, mode in runs]
    torchrun(nproc, job_script("distributed_job.py"), out, model_dir, "--runs", *specs)
    results = {}
    for run, spec in zip(runs, specs):
        with open(os.path.join(out, spec, "row.json")) as f:
            results[run] = torch.load(os.path.join(out, spec, "update.pt")), json.load(f)
    return results


def side_by_side(*calls: Callable[[], object]) -> list:
    """The results of `calls` (functions of no arguments), run at the same time: for independent processes that a
    test launches, each of which keeps about one core busy (a 2-core machine runs two in the time of one)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]


def ahead(
    request, scenarios: dict[str, Callable[[], object]], first: dict[str, Callable[[], object]] | None = None
) -> dict[str, Future]:
    """Start now, two at a time, the `first` scenarios (what several tests compare with), then the scenarios of the
    tests of this module that this session runs, in the tests' order; each test then takes its scenario's result
    (`future.result()`: what it saw, or the exception it raised) and checks it.

    For tests that each drive processes of their own, one after another (a run killed, then resumed): each such
    process keeps about one core busy, so two scenarios side by side take about the time of one on a 2-core
    machine. `scenarios` maps a test's name (`request.node.name`, parameters included) to a function that runs its
    processes and returns what the test asserts on; no scenario may depend on another's timing."""
    selected = [item.name for item in request.session.items if item.module is request.module]
    pool = ThreadPoolExecutor(2)
    futures = {name: pool.submit(run) for name, run in (first or {}).items()}
    futures.update({name: pool.submit(scenarios[name]) for name in selected if name in scenarios})
    pool.shutdown(wait=False)
    return futures
