"""Several machines (docs/server.md's recipe), as two "machines" on loopback: two `accelerate launch` commands with
machine ranks 0 and 1, one training process each, against one `grpo vllm-serve` server, train three steps and end
with the same weights, logs and completions as the same two processes launched once. (Each request carries a seed
drawn from the run's seed, process, generation and request, so the server samples both runs alike.)"""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from safetensors.torch import load_file

from support.launch import free_port, job_env, job_script, side_by_side

JOB = job_script("nodes_job.py")


def accelerate(*flags: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", *flags]


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env=job_env(), timeout=420)


def test_two_machines_train_as_one_launch_of_the_same_processes(servers, vllm_model_dir, tmp_path):
    url = f"http://127.0.0.1:{servers.open}"
    port = str(free_port())
    machines = [
        accelerate(
            "--num_machines",
            "2",
            "--machine_rank",
            str(rank),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            port,
            "--num_processes",
            "2",
            JOB,
            str(tmp_path / "nodes"),
            vllm_model_dir,
            url,
        )
        for rank in (0, 1)
    ]
    done = side_by_side(*(lambda command=command: run(command) for command in machines))
    for result in done:
        assert result.returncode == 0, result.stderr[-4000:]
    once = run(
        accelerate(
            "--num_processes",
            "2",
            "--main_process_port",
            str(free_port()),
            JOB,
            str(tmp_path / "once"),
            vllm_model_dir,
            url,
        )
    )
    assert once.returncode == 0, once.stderr[-4000:]
    for rank in (0, 1):
        nodes, single = (json.load(open(tmp_path / run_ / f"rank{rank}.json")) for run_ in ("nodes", "once"))
        assert nodes["world"] == single["world"] == 2 and len(nodes["steps"]) == 3
        assert nodes["completions"] == single["completions"]
        for a, b in zip(nodes["steps"], single["steps"]):
            assert abs(a["loss"] - b["loss"]) < 1e-6 and a["reward"] == b["reward"]
            assert a["sampling/sampling_logp_difference/max"] < 1e-3
    nodes, single = (load_file(tmp_path / run_ / "weights.safetensors") for run_ in ("nodes", "once"))
    start = load_file(vllm_model_dir + "/model.safetensors")
    assert any(not torch.equal(nodes[n], start[n]) for n in start)  # it trained
    for name in nodes:
        torch.testing.assert_close(nodes[name], single[name], rtol=0, atol=1e-6)
