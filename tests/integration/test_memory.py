"""The training log-prob/entropy pass never holds the full (B, T, V) logits: on a batch whose float32 logits
would take 2.1 GB, the pass (forward and backward, in its own process) peaks under a quarter of that. The same
measurement on an unchunked pass shows the full logits, so it does detect them."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from support.launch import ahead, job_script

JOB = job_script("memory_job.py")


def peak(rows, length, vocab, chunked):
    # a clean environment: settings earlier tests left in os.environ (accelerate's, thread counts) stay out
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": os.environ.get("HOME", ""),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    done = subprocess.run(
        [sys.executable, JOB, str(rows), str(length), str(vocab), str(int(chunked))],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"logits_bytes=(\d+) peak_increase=(-?\d+)", done.stdout)
    return int(found.group(1)), int(found.group(2))


@pytest.fixture(scope="module")
def measured(request):
    """Both tests' measurements, each a process of its own, side by side (`support.ahead`): a process's own peak is
    what is measured, whatever runs beside it."""
    return ahead(
        request,
        {
            "test_chunked_pass_peaks_under_a_quarter_of_the_full_logits": lambda: peak(16, 512, 65536, chunked=True),
            "test_the_measurement_sees_full_logits": lambda: peak(4, 256, 65536, chunked=False),  # 268 MB of logits
        },
    )


def test_chunked_pass_peaks_under_a_quarter_of_the_full_logits(request, measured):
    logits_bytes, increase = measured[request.node.name].result()  # 16 rows of 512 tokens, vocabulary 65536
    assert logits_bytes >= 2 * 10**9
    assert increase < logits_bytes / 4, f"peak rose by {increase / 2**20:.0f} MiB"


def test_the_measurement_sees_full_logits(request, measured):
    logits_bytes, increase = measured[request.node.name].result()  # 4 rows of 256 tokens: 268 MB of logits
    assert increase >= logits_bytes


def _in_the_file_map(model, name: str) -> list[bool]:
    """For each parameter: does its memory lie in this process's memory map of the file `name`?"""
    with open("/proc/self/maps") as f:
        ranges = [[int(x, 16) for x in line.split()[0].split("-")] for line in f if name in line]
    return [any(a <= p.data_ptr() < b for a, b in ranges) for p in model.parameters()]


def test_weights_are_copied_out_of_the_file_map_for_a_cpu_run_only(tiny_model_dir):
    """A CPU run copies the weights into its own memory (the first optimizer step would otherwise pay a page fault
    per page); a GPU run does not copy them on the CPU first, since placement copies them to the GPU anyway.
    Built as the trainer builds its models, for a run on each device (placement itself is not part of this)."""
    import pytest
    import torch

    from grpo import GRPOConfig
    from grpo.models.build import build

    if not os.path.exists("/proc/self/maps"):
        pytest.skip("no /proc/self/maps here")
    args = GRPOConfig(output_dir="x", beta=0.04, per_device_train_batch_size=2, num_generations=2)
    for device, mapped in ((torch.device("cuda"), True), (torch.device("cpu"), False)):
        built = build(str(tiny_model_dir), None, None, args, None, device)
        assert _in_the_file_map(built.model, "model.safetensors") == [mapped] * len(list(built.model.parameters()))
        assert all(m == mapped for m in _in_the_file_map(built.ref_model, "model.safetensors"))
