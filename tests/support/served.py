"""`grpo vllm-serve` (vLLM's own server, `grpo.serve.launcher`) in processes of their own for the vLLM tests:
started on a free 127.0.0.1 port in float32 (a later `--dtype` in `extra` wins) with a small KV cache, waited for
on /health, spoken to in JSON. A server takes about 30 s to come up on 2 cores (three processes, each importing
vLLM), so the tiny model's plain float32 server and its keyed bfloat16 twin are the session's (`servers` in
conftest.py), shared by every test that only needs a server to push to and sample from."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from support.launch import free_port

KEY = "secret"  # the keyed server's


def server_env(**extra: str) -> dict:
    """The tests' environment without a key in GRPO_VLLM_API_KEY or VLLM_API_KEY (a server would take it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GRPO_VLLM_API_KEY", "VLLM_API_KEY")}
    return {**env, **extra}


def request(port, method, path, body=None, headers=None, timeout=60):
    """(status, decoded JSON answer) of one request; `body` a dict is sent as JSON, bytes as they are."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        if isinstance(body, dict):
            headers = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def start(
    model_dir: str, log_dir: str | Path, *extra: str, port: int | None = None, env: dict | None = None
) -> subprocess.Popen:
    """The server's process, not yet answering (see `wait`); its output goes to a log in `log_dir`."""
    port = port or free_port()
    command = [sys.executable, "-m", "grpo", "vllm-serve", "--model", model_dir, "--port", str(port)]
    command += ["--dtype", "float32", "--kv-cache-gib", "0.05", *extra]
    log = open(Path(log_dir) / f"server-{port}.log", "w")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env or server_env())
    proc.port, proc.log = port, log.name
    return proc


def wait(proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until the server answers /health; its log's tail in the error if it exits or does not answer in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{Path(proc.log).read_text()[-3000:]}")
        try:
            if request(proc.port, "GET", "/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /health in {timeout} s:\n{Path(proc.log).read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not ended 20 s later (vLLM's engine and worker processes end with it)."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        kill(proc)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the server and the processes it started (vLLM's engine core and workers), as a crash of the machine
    would: a killed API server alone leaves its engine holding the port's memory until it notices."""
    for child in _descendants(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    proc.kill()
    proc.wait()


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            children = []
        out += children
        todo += children
    return out


class Server:
    """A server started and answering; `kill()` ends it at once (SIGKILL, as a crash would)."""

    def __init__(self, model_dir: str, port: int | None = None, *extra: str, env: dict | None = None) -> None:
        self.log_dir = tempfile.mkdtemp(prefix="grpo-server-")  # its log (in `wait`'s errors); removed by `kill`
        self.proc = start(model_dir, self.log_dir, *extra, port=port, env=env)
        self.port = self.proc.port
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            wait(self.proc)
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        kill(self.proc)
        shutil.rmtree(self.log_dir, ignore_errors=True)
