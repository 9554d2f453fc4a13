"""Training against a `grpo vllm-serve` server (`vllm_mode="server"`) on this CPU: the server samples the policy's
weights after each push and not without one, two trainer processes share one server, a server killed mid-run
stops the run with a clear error (checkpoints intact) and a resume continues once a server is back, and a
server with a key refuses a trainer without it."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from types import SimpleNamespace

import pytest
import torch

from grpo.rollout.base import Request
from grpo.rollout.remote import ServerError
from served import Server
from support import torchrun
from test_vllm_engine import FP32_TOL, fixed_completion, make_trainer, perturb, policy_logps

JOB = os.path.join(os.path.dirname(__file__), "vllm_job.py")


@pytest.fixture(scope="module")
def server(servers):
    """The session's open server (conftest.py)."""
    return SimpleNamespace(port=servers.open, url=f"http://127.0.0.1:{servers.open}")


def served(trainer, prompt, completion_len=12):
    """One completion sampled by the server with its log-probs, and the policy's log-probs of the same tokens."""
    request = Request(trainer.prompts[0], num_samples=1, max_tokens=completion_len)
    rollout = trainer.engine.generate([request])
    tokens = rollout.completion_ids[0]
    return torch.tensor(rollout.sampling_logps[0]), policy_logps(trainer, list(rollout.prompt_ids[0]), tokens)


def test_the_server_samples_the_pushed_policy_and_a_skipped_push_shows(server, vllm_model_dir, tmp_path):
    trainer = make_trainer(vllm_model_dir, tmp_path, vllm_mode="server", vllm_server_port=server.port, max_steps=2)
    trainer.train()
    assert trainer.engine.version is not None
    with urllib.request.urlopen(server.url + "/health") as response:
        assert json.loads(response.read())["weight_version"] == trainer.engine.version
    trainer.engine.sync_weights(trainer.unwrapped_model)
    prompt, _ = fixed_completion(trainer)
    server_logps, policy = served(trainer, prompt)
    assert (server_logps - policy).abs().max() < FP32_TOL
    perturb(trainer.unwrapped_model)  # not pushed
    server_logps, policy = served(trainer, prompt)
    assert (server_logps - policy).abs().mean() > 100 * FP32_TOL
    for row in trainer.state.log_history:
        assert row["sampling/sampling_logp_difference/max"] < FP32_TOL


def test_two_trainer_processes_share_one_server(server, vllm_model_dir, tmp_path):
    torchrun(2, JOB, tmp_path, vllm_model_dir, f"server:{server.port}", timeout=420)
    rows = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(2)]
    assert [r["world"] for r in rows] == [2, 2]
    for row in rows:
        assert row["sampling"]["sampling/sampling_logp_difference/max"] < FP32_TOL


def test_two_async_trainer_processes_share_one_server_in_lockstep(server, vllm_model_dir, tmp_path):
    """async_generation on two processes and one server, which holds one weight version: the producers push and
    generate round by round together (process 1 starting its requests late), and stop between rounds for the
    evaluation (which pushes the learner's weights); every round was sampled from the snapshot whose log-probs the
    learner trained against. (Without the producers' barrier before a push, or the learners' before the
    evaluation's, process 1's late requests meet a server pushed to meanwhile: 409.)"""
    torchrun(2, JOB, tmp_path, vllm_model_dir, f"server:{server.port}+async", timeout=420)
    rows = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(2)]
    for row in rows:
        assert [r["sample/staleness_mean"] for r in row["steps"]] == [0, 1, 1, 1]
        assert all(r["sampling/sampling_logp_difference/max"] < FP32_TOL for r in row["steps"])
        assert row["evaluations"] == 1


def test_a_run_whose_weights_another_run_replaced_is_refused_by_name(server, vllm_model_dir, tmp_path):
    """Versions belong to the server: run B's push gets a number of its own, so run A, generating after it
    without pushing, is refused with B named, instead of sampling B's weights."""
    a = make_trainer(vllm_model_dir, tmp_path / "a", vllm_mode="server", vllm_server_port=server.port, run_name="A")
    b = make_trainer(vllm_model_dir, tmp_path / "b", vllm_mode="server", vllm_server_port=server.port, run_name="B")
    a.engine.sync_weights(a.unwrapped_model)
    b.engine.sync_weights(b.unwrapped_model)
    assert b.engine.version == a.engine.version + 1 and a.engine.run.startswith("A (")
    with pytest.raises(ServerError, match=r"\(409\).*pushed by run 'B \(.*Another run pushed"):
        served(a, None)
    served(b, None)  # B's own weights: served
    a.engine.sync_weights(a.unwrapped_model)  # A pushes again: A is served, B is refused
    served(a, None)
    with pytest.raises(ServerError, match="pushed by run 'A"):
        served(b, None)


def test_a_server_killed_mid_run_stops_it_clearly_and_resume_continues(vllm_model_dir, tmp_path):
    s = Server(vllm_model_dir)
    args = dict(vllm_mode="server", vllm_server_port=s.port, vllm_server_timeout=5.0, max_steps=3)
    trainer = make_trainer(vllm_model_dir, tmp_path, save_strategy="steps", save_steps=1, **args)
    original, calls = trainer.engine.generate, []

    def dies_on_the_second_generation(requests):
        calls.append(1)
        if len(calls) == 2:
            s.kill()
        return original(requests)

    trainer.engine.generate = dies_on_the_second_generation
    start = time.monotonic()
    with pytest.raises(ServerError, match=r"stopped answering|No vLLM server|refused"):
        trainer.train()
    assert time.monotonic() - start < 120  # no hang
    assert os.path.isdir(tmp_path / "out" / "checkpoint-1")
    back = Server(vllm_model_dir, s.port)
    try:
        resumed = make_trainer(vllm_model_dir, tmp_path, save_strategy="steps", save_steps=1, **args)
        resumed.train(resume_from_checkpoint=True)
        assert resumed.state.global_step == 3
    finally:
        back.kill()


@pytest.fixture(scope="module")
def keyed_bfloat16_server(vllm_model_dir):
    """A bfloat16 server with a key, for the key's test and the bfloat16 one."""
    s = Server(vllm_model_dir, None, "--dtype", "bfloat16", "--api-key", "s3cret")
    yield s
    s.kill()


def test_a_server_with_a_key_refuses_a_trainer_without_it(vllm_model_dir, tmp_path, keyed_bfloat16_server):
    s = keyed_bfloat16_server
    trainer = make_trainer(vllm_model_dir, tmp_path, vllm_mode="server", vllm_server_port=s.port)
    with pytest.raises(ServerError, match=r"refused /update_weights \(401\).*vllm_server_api_key"):
        trainer.train()
    keyed = make_trainer(
        vllm_model_dir, tmp_path / "k", vllm_mode="server", vllm_server_port=s.port, vllm_server_api_key="s3cret"
    )
    keyed.train()
    assert keyed.state.global_step == 1


def test_a_bfloat16_server_samples_the_pushed_lora_policy_within_its_tolerance(
    vllm_model_dir, tmp_path, keyed_bfloat16_server
):
    """A bfloat16 server and a LoRA policy: the push carries base + adapter delta in the server's dtype; its
    log-probs match the (bfloat16 autocast) policy's within the bf16 tolerance, and not the adapter-less base's."""
    from peft import LoraConfig

    from test_vllm_engine import BF16_MAX_TOL, BF16_MEAN_TOL

    s = keyed_bfloat16_server
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    trainer = make_trainer(
        vllm_model_dir,
        tmp_path,
        peft_config=lora,
        bf16=True,
        vllm_mode="server",
        vllm_server_port=s.port,
        vllm_server_api_key="s3cret",
    )
    assert trainer.engine.info["dtype"] == "bfloat16"
    trainer.train()
    trainer.engine.sync_weights(trainer.unwrapped_model)
    rollout = trainer.engine.generate([Request(trainer.prompts[0], num_samples=1, max_tokens=12)])
    prompt, tokens = list(rollout.prompt_ids[0]), rollout.completion_ids[0]
    server_logps = torch.tensor(rollout.sampling_logps[0])
    diff = (server_logps - policy_logps(trainer, prompt, tokens)).abs()
    assert diff.mean() < BF16_MEAN_TOL and diff.max() < BF16_MAX_TOL
    with trainer.unwrapped_model.disable_adapter():
        base = (server_logps - policy_logps(trainer, prompt, tokens)).abs()
    assert base.mean() > max(2 * diff.mean(), BF16_MEAN_TOL)  # the adapters reached the server
