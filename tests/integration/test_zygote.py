"""The zygote the job tests fork from (support/zygote.py) gives each job what a fresh `python script args` gets: its
argv, environment, working directory and streams, its own exit status (an exception's 1, SystemExit's code, -N when
killed by signal N), freshly seeded random generators and torch's thread count from its OMP_NUM_THREADS; and it
refuses a job whose environment differs in a variable the preloaded libraries read at import."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from support import zygote

SCRIPT = """
import json, os, random, sys
import numpy, torch
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "x": os.environ.get("JOB_X"), "random": random.random(),
                  "numpy": float(numpy.random.random()), "threads": torch.get_num_threads(),
                  "main": __name__, "path0": sys.path[0]}), flush=True)
if sys.argv[1] == "sleep":
    import time
    time.sleep(60)
if sys.argv[1] == "raise":
    raise ValueError("from the job")
sys.exit(int(sys.argv[2]))
"""


def run(script, tmp_path, *args, env=None, cwd=None):
    out = tmp_path / f"out{time.monotonic_ns()}"
    with open(out, "w") as f:
        job = zygote.fork([script, *args], env=env, stdout=f, stderr=f, cwd=cwd)
        code = job.wait(120)
    return code, out.read_text()


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return str(path)


def test_a_job_gets_its_own_argv_environment_directory_and_exit_status(script, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), JOB_X="7", OMP_NUM_THREADS="1")
    code, out = run(script, tmp_path, "exit", "3", env=env, cwd=str(tmp_path))
    seen = json.loads(out)
    assert code == 3
    assert seen["argv"] == [script, "exit", "3"] and seen["cwd"] == str(tmp_path) and seen["x"] == "7"
    assert seen["main"] == "__main__" and seen["path0"] == os.path.dirname(script)  # as `python script`
    assert seen["threads"] == 1
    code, out = run(script, tmp_path, "exit", "0")
    again = json.loads(out)
    assert code == 0 and again["x"] is None
    # seeded again in each job, as a fresh interpreter seeds them from the OS
    assert again["random"] != seen["random"] and again["numpy"] != seen["numpy"]
    code, out = run(script, tmp_path, "raise")
    assert code == 1 and "ValueError: from the job" in out


def test_a_job_is_signalled_and_killed_by_pid(script, tmp_path):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        r, w = os.pipe()
        job = zygote.fork([script, "sleep"], stdout=w)
        os.close(w)
        with os.fdopen(r) as stdout:
            stdout.readline()  # it runs
        assert job.poll() is None
        job.send_signal(sig)
        assert job.wait(30) == -sig


def test_a_job_whose_import_time_environment_differs_is_refused(script):
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is read when the zygote imports"):
        zygote.fork([script, "exit", "0"], env=dict(os.environ, HF_HUB_OFFLINE="0"))
