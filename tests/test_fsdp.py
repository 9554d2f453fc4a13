"""Generation with sharded parameters (FSDP2 on CPU, 2 processes): the lean decoder gathers the shards for the
rollout, samples exactly what the unsharded model samples, and leaves the parameters sharded again."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_distributed import free_port

JOB = os.path.join(os.path.dirname(__file__), "fsdp_job.py")


def test_sampling_from_a_sharded_model_equals_the_whole_model(tmp_path):
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2")
    out = tmp_path / "fsdp.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", JOB,
           str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2
    assert result["ids"] == result["whole_ids"]
    assert any(len(ids) > 1 for ids in result["ids"])
    for row, whole in zip(result["logps"], result["whole_logps"]):
        assert row == pytest.approx(whole, rel=1e-5, abs=1e-6)
    assert result["resharded"]
