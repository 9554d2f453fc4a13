"""async_generation on vLLM's engines (CPU build): the producer pushes its snapshot's weights to the engine before
each round, so the engine samples exactly the behaviour policy whose log-probs the learner trains against (the
sampling/* metrics compare the two), for the colocated engine and for a `grpo vllm-serve` server; an evaluation
between rounds samples the learner's own weights, and the producer pushes its snapshot again after it."""

from __future__ import annotations

import json

import torch

from support.launch import job_script, torchrun
from support.vllm_runs import FP32_TOL, engine_logps, fixed_completion, make_trainer, policy_logps

JOB = job_script("vllm_job.py")


def check_rounds(trainer, steps):
    rows = [row for row in trainer.state.log_history if "sample/staleness_mean" in row]
    assert [row["sample/staleness_mean"] for row in rows] == [0] + [1] * (steps - 1)
    for row in rows:  # the engine sampled the snapshot the behaviour log-probs were computed on
        assert row["sampling/sampling_logp_difference/max"] < FP32_TOL
    assert any(abs(row["sample/importance_weight_max"] - 1) > 1e-3 for row in rows[1:])  # one update behind


def test_colocated_vllm_samples_the_producers_snapshot(vllm_model_dir, tmp_path):
    trainer = make_trainer(vllm_model_dir, tmp_path, max_steps=4, async_generation=True, max_staleness=1)
    trainer.train()
    check_rounds(trainer, 4)
    # after training the engine may hold the snapshot (one version behind): evaluation pushes the policy itself
    trainer.evaluate(trainer.train_dataset.select(range(2)))
    prompt, completion = fixed_completion(trainer)
    difference = engine_logps(trainer.engine, prompt, completion) - policy_logps(trainer, prompt, completion)
    assert difference.abs().max() < FP32_TOL


def test_a_server_samples_the_producers_snapshot(vllm_model_dir, tmp_path, servers):
    trainer = make_trainer(
        vllm_model_dir,
        tmp_path,
        vllm_mode="server",
        vllm_server_port=servers.open,
        max_steps=4,
        async_generation=True,
        max_staleness=1,
    )
    trainer.train()
    check_rounds(trainer, 4)


def test_colocated_async_runs_are_reproducible(vllm_model_dir, tmp_path):
    """vLLM's in-process sampler draws from torch's global generator: each round reseeds it under the lock the
    learner's micro-steps take, so two runs of one seed train the same weights."""
    runs = []
    for name in ("a", "b"):
        trainer = make_trainer(vllm_model_dir, tmp_path / name, max_steps=3, async_generation=True)
        assert trainer.parts.rounds.lock_rng
        trainer.train()
        runs.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


def test_two_processes_each_with_its_engine_train_async(vllm_model_dir, tmp_path):
    """Colocated engines on two processes (one each): every producer pushes its snapshot to its own engine, which
    samples exactly the behaviour policy; an evaluation between rounds pushes the learner's weights."""
    torchrun(2, JOB, tmp_path, vllm_model_dir, "ddp+async", timeout=420)
    rows = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(2)]
    for row in rows:
        assert [r["sample/staleness_mean"] for r in row["steps"]] == [0, 1, 1, 1]
        assert all(r["sampling/sampling_logp_difference/max"] < FP32_TOL for r in row["steps"])
        assert row["evaluations"] == 1
