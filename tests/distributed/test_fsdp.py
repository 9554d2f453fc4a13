"""Sharded parameters (FSDP2 on CPU, 2 processes): the lean decoder gathers the shards for the rollout, samples
exactly what the unsharded model samples and leaves the parameters sharded again; the training pass (prefix
sharing, tiled output head reading the root's weight outside the module's forward) gives the unsharded model's
log-probs and gradients (float32, rtol 1e-5)."""

from __future__ import annotations

import json

import pytest
import torch

from support.launch import job_script, torchrun

JOB = job_script("fsdp_job.py")


def test_sampling_from_a_sharded_model_equals_the_whole_model(tmp_path):
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2")
    out = tmp_path / "fsdp.json"
    torchrun(2, JOB, out)
    result = json.loads(out.read_text())
    assert result["world"] == 2
    assert result["ids"] == result["whole_ids"]
    assert any(len(ids) > 1 for ids in result["ids"])
    for row, whole in zip(result["logps"], result["whole_logps"]):
        assert row == pytest.approx(whole, rel=1e-5, abs=1e-6)
    assert result["resharded"]
    torch.testing.assert_close(torch.tensor(result["train"]), torch.tensor(result["whole_train"]), rtol=1e-5, atol=1e-6)
    grads = torch.load(f"{out}.grads.pt")
    for name, whole in grads["whole_grads"].items():
        assert whole.abs().sum() > 0, name
        torch.testing.assert_close(grads["grads"][name], whole, rtol=1e-5, atol=1e-6)


def run_resume_job(out, mode):
    torchrun(2, RESUME_JOB, out, mode)
    return torch.load(out / f"{mode}.pt")


RESUME_JOB = job_script("fsdp_resume_job.py")


def test_sharded_checkpoint_resumes_bit_identically(tmp_path):
    """2 steps, a sharded checkpoint (model and AdamW shards, every process), then a fresh process group resumes
    and takes step 3: the whole parameters equal 3 straight steps bit for bit; the gathered state dict is whole."""
    straight = run_resume_job(tmp_path, "straight")
    saved = run_resume_job(tmp_path, "save")
    resumed = run_resume_job(tmp_path, "resume")
    assert set(resumed) == set(straight)
    assert any(not torch.equal(saved[k], straight[k]) for k in straight)  # the third step moved the weights
    for name, tensor in straight.items():
        assert not hasattr(tensor, "full_tensor")  # gathered whole, plain tensors
        assert torch.equal(resumed[name], tensor), name
