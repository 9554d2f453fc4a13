"""Training against vLLM's own server (`vllm_mode="server"`, `grpo vllm-serve`) on this CPU, weights through grpo's
gloo weight-transfer engine: the server samples the policy's weights after each push and not without one, two
trainer processes share one server, a run whose server another run took over is refused by name, a server killed
in a push stops the run with a clear error naming it (checkpoints intact) and a resume continues on a server that
is up, a keyed server refuses a trainer without its key, a bfloat16 server takes a LoRA policy's merged weights, and
two servers (one of them split in two shards) share a run's requests and each get every push."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerCallback

from grpo.base.records import Request
from grpo.rollout.remote import ServerError
from support import served as served_
from support.launch import job_script, torchrun
from support.served import KEY, request
from support.vllm_runs import (
    BF16_MAX_TOL,
    BF16_MEAN_TOL,
    FP32_TOL,
    fixed_completion,
    make_trainer,
    perturb,
    policy_logps,
)

JOB = job_script("vllm_job.py")


@pytest.fixture(scope="module")
def server(servers):
    """The session's open server (conftest.py)."""
    return SimpleNamespace(port=servers.open, url=f"http://127.0.0.1:{servers.open}", log=servers.open_log)


def served(trainer, completion_len=12):
    """One completion sampled by the server(s) with its log-probs, and the policy's log-probs of the same tokens."""
    request_ = Request(trainer.parts.prompts[0], num_samples=1, max_tokens=completion_len)
    rollout = trainer.engine.generate([request_])
    tokens = rollout.completion_ids[0]
    return torch.tensor(rollout.sampling_logps[0]), policy_logps(trainer, list(rollout.prompt_ids[0]), tokens)


def _transport_logged(log: str) -> str:
    """The transport of the last connection in a server's log (grpo's worker logs each)."""
    with open(log) as f:
        return [line.rsplit("weights through ", 1)[1].strip(" .\n") for line in f if "weights through " in line][-1]


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_the_server_samples_the_pushed_policy_and_a_skipped_push_shows(
    server, vllm_model_dir, tmp_path, monkeypatch, transport
):
    """On this host the weights go through shared memory; with GRPO_WEIGHTS_TRANSPORT=tcp on the trainer's side
    (as between hosts), over TCP; the server holds the policy's weights either way."""
    monkeypatch.setenv("GRPO_WEIGHTS_TRANSPORT", transport)
    trainer = make_trainer(vllm_model_dir, tmp_path, vllm_mode="server", vllm_server_port=server.port, max_steps=2)
    trainer.train()
    expected = "TCP" if transport == "tcp" else "shared memory"
    engine, _ = trainer.engine.transfers[0]
    assert engine.link.transport == expected and _transport_logged(server.log) == expected
    assert trainer.engine.version.endswith(" #2")  # the policy at its start, then after the first step
    assert request(server.port, "GET", "/weight_info")[1]["weight_version"] == trainer.engine.version
    trainer.engine.sync_weights(trainer.unwrapped_model)
    fixed_completion(trainer)
    server_logps, policy = served(trainer)
    assert (server_logps - policy).abs().max() < FP32_TOL
    perturb(trainer.unwrapped_model)  # not pushed
    server_logps, policy = served(trainer)
    assert (server_logps - policy).abs().mean() > 100 * FP32_TOL
    for row in trainer.state.log_history:
        assert row["sampling/sampling_logp_difference/max"] < FP32_TOL


def test_two_trainer_processes_share_one_server(server, vllm_model_dir, tmp_path):
    torchrun(2, JOB, tmp_path, vllm_model_dir, f"server:{server.port}", timeout=420)
    rows = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(2)]
    assert [r["world"] for r in rows] == [2, 2]
    for row in rows:
        assert row["sampling"]["sampling/sampling_logp_difference/max"] < FP32_TOL


@pytest.mark.parametrize("sharding", ["fsdp", "zero3"])
def test_a_sharded_policy_is_gathered_by_every_process_and_sent_by_the_main_one(
    server, vllm_model_dir, tmp_path, sharding
):
    """FSDP and DeepSpeed ZeRO-3 on two processes: each push gathers the policy on both (a collective), then the
    main process alone sends; the server samples the policy's log-probs, and its version is the run's."""
    torchrun(2, JOB, tmp_path, vllm_model_dir, f"{sharding}+server:{server.port}", timeout=420)
    rows = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(2)]
    for row in rows:
        assert row["sampling"]["sampling/sampling_logp_difference/max"] < FP32_TOL
    version = request(server.port, "GET", "/weight_info")[1]["weight_version"]
    assert version.endswith(" #3")  # the start, the step, and the job's last push


def test_two_async_trainer_processes_share_one_server_in_lockstep(server, vllm_model_dir, tmp_path):
    """async_generation on two processes and one server, which holds one weight version: the producers push and
    generate round by round together (process 1 starting its requests late), and stop between rounds for the
    evaluation (which pushes the learner's weights); every round was sampled from the snapshot whose log-probs the
    learner trained against. (Without the producers' barrier before a push, or the learners' before the
    evaluation's, process 1's late requests meet a server pushed to meanwhile: refused.)"""
    torchrun(2, JOB, tmp_path, vllm_model_dir, f"server:{server.port}+async", timeout=420)
    rows = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(2)]
    for row in rows:
        assert [r["sample/staleness_mean"] for r in row["steps"]] == [0, 1, 1, 1]
        assert all(r["sampling/sampling_logp_difference/max"] < FP32_TOL for r in row["steps"])
        assert row["evaluations"] == 1


def test_a_run_whose_server_another_run_took_over_is_refused_by_name(server, vllm_model_dir, tmp_path):
    """Run B pushes to the server run A pushes to (its first push connects, taking the server's weight transfer
    over): A's next generation and A's next push are errors naming B (vLLM's weight version says whose weights the
    server holds), so nothing B's weights sampled reaches A; B samples its own."""
    a = make_trainer(vllm_model_dir, tmp_path / "a", vllm_mode="server", vllm_server_port=server.port, run_name="A")
    a.engine.sync_weights(a.unwrapped_model)
    served(a)
    b = make_trainer(vllm_model_dir, tmp_path / "b", vllm_mode="server", vllm_server_port=server.port, run_name="B")
    b.engine.sync_weights(b.unwrapped_model)
    with pytest.raises(ServerError, match=r"holds weight version 'B \(.*#1' before a generation.*expects 'A \("):
        served(a)
    with pytest.raises(ServerError, match=r"holds weight version 'B \(.*before pushing"):
        a.engine.sync_weights(a.unwrapped_model)
    server_logps, policy = served(b)
    assert (server_logps - policy).abs().max() < FP32_TOL


def test_a_server_of_another_model_is_one_error_naming_it_and_keeps_serving(server, vllm_model_dir, tmp_path):
    """The policy has 3 layers, the server's model 2 (same tokenizer: the probe text passes): the first push is
    refused when the run connects, naming what differs, before anything is sent; the server serves the next run."""
    from support import tiny

    deeper = tmp_path / "deeper"
    tokenizer = tiny.make_tokenizer()
    tiny.make_model(tokenizer, hidden=128, layers=3, context=2048).save_pretrained(deeper)
    tokenizer.save_pretrained(deeper)
    trainer = make_trainer(str(deeper), tmp_path / "a", vllm_mode="server", vllm_server_port=server.port)
    with pytest.raises(ServerError, match=r"trains another model than this server serves.*num_hidden_layers 3 \(this"):
        trainer.engine.sync_weights(trainer.unwrapped_model)
    fine = make_trainer(vllm_model_dir, tmp_path / "b", vllm_mode="server", vllm_server_port=server.port)
    fine.train()
    assert fine.state.log_history[-1]["sampling/sampling_logp_difference/max"] < FP32_TOL


def test_a_keyed_bfloat16_server_refuses_a_trainer_without_its_key_and_takes_a_lora_policy(
    vllm_model_dir, tmp_path, servers
):
    """The keyed session server (bfloat16): a trainer without the key is refused before its first step, naming
    the setting; with it, a LoRA policy's push carries base + adapter delta in the server's dtype, whose log-probs
    match the (bfloat16 autocast) policy's within the bf16 tolerance, and not the adapter-less base's."""
    from peft import LoraConfig

    with pytest.raises(ServerError, match=r"refused /server_info.*\(401\).*vllm_server_api_key"):
        make_trainer(vllm_model_dir, tmp_path / "k", vllm_mode="server", vllm_server_port=servers.keyed)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    keyed = dict(vllm_mode="server", vllm_server_port=servers.keyed, vllm_server_api_key=KEY)
    trainer = make_trainer(vllm_model_dir, tmp_path, peft_config=lora, bf16=True, **keyed)
    assert trainer.engine.info["dtype"] == "bfloat16"
    trainer.train()
    trainer.engine.sync_weights(trainer.unwrapped_model)
    rollout = trainer.engine.generate([Request(trainer.parts.prompts[0], num_samples=1, max_tokens=12)])
    prompt, tokens = list(rollout.prompt_ids[0]), rollout.completion_ids[0]
    server_logps = torch.tensor(rollout.sampling_logps[0])
    diff = (server_logps - policy_logps(trainer, prompt, tokens)).abs()
    assert diff.mean() < BF16_MEAN_TOL and diff.max() < BF16_MAX_TOL
    with trainer.unwrapped_model.disable_adapter():
        base = (server_logps - policy_logps(trainer, prompt, tokens)).abs()
    assert base.mean() > max(2 * diff.mean(), BF16_MEAN_TOL)  # the adapters reached the server


def test_two_servers_share_a_runs_requests_and_pushes_and_one_killed_in_a_push_is_named(
    server, servers, vllm_model_dir, tmp_path
):
    """vllm_server_base_url with two servers, the second split in two shards (--tensor-parallel-size 2, a worker
    process each, both in the gloo group): the first step's requests go to both, both hold the run's version after
    its push and sample the policy's log-probs. The second server (all its processes) is then killed halfway through
    the second push: one error naming it, in seconds; the first step's checkpoint is intact, and the resume continues
    on the server that is up."""
    shards = SimpleNamespace(url=f"http://127.0.0.1:{servers.shards.port}")
    urls = f"{server.url},{shards.url}"
    args = dict(vllm_mode="server", vllm_server_timeout=10.0, max_steps=3, save_strategy="steps", save_steps=1)
    trainer = make_trainer(vllm_model_dir, tmp_path, vllm_server_base_url=urls, **args)
    assert [f["world_size"] for f in trainer.engine.facts] == [1, 2]
    calls = {url: 0 for url in urls.split(",")}
    for client in trainer.engine.servers:
        original = client.while_alive

        def counted(method, path, body=None, client=client, original=original, **options):
            calls[client.url] += path == "/v1/completions"
            return original(method, path, body, **options)

        client.while_alive = counted
    held = []

    class DiesHalfwaySent(list):
        """The second push's tensors to the second server, which is killed when half of them are sent (the first
        walk reads the metadata, the second sends)."""

        walks = 0

        def __iter__(self):
            DiesHalfwaySent.walks += 1
            for i, pair in enumerate(list.__iter__(self)):
                if DiesHalfwaySent.walks == 2 and i == len(self) // 2:
                    served_.kill(servers.shards)
                yield pair

    connect, pushes = trainer.engine._connect, []

    def connected(index):
        engine, source = connect(index)
        if index == 1:
            send = engine.send_weights

            def dies_in_the_second_push():
                pushes.append(1)
                if len(pushes) == 2:
                    source.pairs = DiesHalfwaySent(source.pairs)
                return send()

            engine.send_weights = dies_in_the_second_push
        return engine, source

    class Versions(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:  # after the first step: both servers hold its push
                held.extend(request(int(url.rsplit(":", 1)[1]), "GET", "/weight_info")[1] for url in calls)

    trainer.engine._connect = connected
    trainer.add_callback(Versions())
    start = time.monotonic()
    with pytest.raises(ServerError, match=rf"vLLM server at {shards.url} .*(stopped answering|failed|reached)"):
        trainer.train()
    assert time.monotonic() - start < 120  # no hang
    assert all(count >= 1 for count in calls.values()), calls
    assert [h["weight_version"] for h in held] == [trainer.engine.version] * 2 and trainer.engine.version.endswith("#1")
    assert trainer.state.log_history[0]["sampling/sampling_logp_difference/max"] < FP32_TOL  # both servers' samples
    assert os.path.isdir(tmp_path / "out" / "checkpoint-1")
    resumed = make_trainer(vllm_model_dir, tmp_path, vllm_server_port=server.port, **args)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    assert resumed.state.log_history[-1]["sampling/sampling_logp_difference/max"] < FP32_TOL
