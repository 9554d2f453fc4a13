"""`grpo vllm-serve` (grpo.serve.server) in processes of its own on the tiny head-size-32 Llama: log-probs equal the
model's own, a weight update changes them to the pushed model's, stale versions are refused, the key is required
wherever it must be, and no bad request takes the server down."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save
from transformers import AutoConfig, AutoModelForCausalLM

from grpo.rollout.vllm import sampling_kwargs
from served import KEY, request, server_env, start, stop, wait
from support import side_by_side

FP32_TOL = 1e-3
EOS = 1  # tiny.SPECIALS
PROMPTS = [[4, 10, 11, 12], [4, 20, 21]]


def sampling(max_tokens: int = 8) -> dict:
    """What the trainer's engines would send: grpo.rollout.vllm.sampling_kwargs at temperature 1 (processed
    log-probs = the model's log-softmax)."""
    args = SimpleNamespace(
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        max_completion_length=max_tokens,
        generation_kwargs=None,
        vllm_structured_outputs_regex=None,
    )
    return sampling_kwargs(args, [EOS])


def generate(port, n=3, version=None, headers=None, max_tokens=8):
    body = {
        "requests": [{"prompt_ids": p, "n": n, "max_tokens": max_tokens} for p in PROMPTS],
        "sampling": sampling(max_tokens),
        "weight_version": version,
    }
    return request(port, "POST", "/generate", body, headers)


@torch.no_grad()
def model_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(completion)), torch.tensor(completion)]


def max_diff(outputs, model) -> float:
    worst = 0.0
    for prompt, samples in zip(PROMPTS, outputs):
        for sample in samples:
            expected = model_logps(model, prompt, sample["token_ids"])
            worst = max(worst, (torch.tensor(sample["logprobs"]) - expected).abs().max().item())
    return worst


def push(port, model, run="test", headers=None):
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    return push_bytes(port, save(state), run, headers)


def push_bytes(port, data: bytes, run="test", headers=None):
    headers = {"Content-Type": "application/octet-stream", "X-Run": run, **(headers or {})}
    return request(port, "POST", "/update_weights", data, headers)


def version_of(port) -> int:
    return request(port, "GET", "/weight_version")[1]["weight_version"]


def reference_vocab(model_dir) -> int:
    return AutoConfig.from_pretrained(model_dir).vocab_size


@pytest.fixture(scope="module")
def reference(vllm_model_dir):
    return AutoModelForCausalLM.from_pretrained(vllm_model_dir, torch_dtype=torch.float32).eval()


def test_health_describes_the_server(servers, vllm_model_dir):
    status, answer = request(servers.open, "GET", "/health")
    assert status == 200
    assert answer["status"] == "ok" and answer["model"] == vllm_model_dir
    assert answer["dtype"] == "float32" and answer["max_model_len"] == 512 and isinstance(answer["weight_version"], int)
    assert answer["vocab_size"] == reference_vocab(vllm_model_dir)


def test_generation_returns_n_completions_with_the_models_log_probs(servers, reference):
    status, answer = generate(servers.open, n=3)
    assert status == 200, answer
    assert len(answer["outputs"]) == len(PROMPTS) and all(len(samples) == 3 for samples in answer["outputs"])
    for samples in answer["outputs"]:
        for sample in samples:
            assert 1 <= len(sample["token_ids"]) <= 8 and len(sample["logprobs"]) == len(sample["token_ids"])
    assert max_diff(answer["outputs"], reference) < FP32_TOL


def test_a_weight_update_changes_the_log_probs_to_the_pushed_models(servers, reference, vllm_model_dir):
    perturbed = AutoModelForCausalLM.from_pretrained(vllm_model_dir, torch_dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    version = version_of(servers.open) + 1  # the server numbers pushes itself: the next one is this
    try:
        assert push(servers.open, perturbed, "A") == (200, {"weight_version": version, "run": "A"})
        assert request(servers.open, "GET", "/weight_version") == (200, {"weight_version": version, "run": "A"})
        status, answer = generate(servers.open, version=version)
        assert status == 200 and answer["weight_version"] == version
        assert max_diff(answer["outputs"], perturbed) < FP32_TOL
        assert max_diff(answer["outputs"], reference) > 100 * FP32_TOL
        status, answer = generate(servers.open, version=version - 1)  # the client thinks it is older: refused
        assert status == 409 and "weight version" in answer["error"]
    finally:  # the original weights back, for the other tests
        assert push(servers.open, reference, "B") == (200, {"weight_version": version + 1, "run": "B"})
    status, answer = generate(servers.open, version=version)  # A's version, now B's weights: refused, by name
    assert status == 409 and "pushed by run 'B'" in answer["error"]
    assert max_diff(generate(servers.open, version=version + 1)[1]["outputs"], reference) < FP32_TOL


def test_an_update_with_wrong_names_or_shapes_is_refused_and_changes_nothing(servers, reference):
    before = version_of(servers.open)
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    renamed = dict(state)
    renamed["model.not_a_layer.weight"] = renamed.pop("model.norm.weight")
    reshaped = {**state, "model.norm.weight": torch.ones(7)}
    missing = {k: v for k, v in state.items() if k != "lm_head.weight"}
    nan = {**state, "model.norm.weight": torch.full_like(state["model.norm.weight"], float("nan"))}
    for bad in (renamed, reshaped, missing, nan):
        status, answer = push_bytes(servers.open, save(bad))
        assert status == 400 and "error" in answer
    assert push_bytes(servers.open, b"not safetensors")[0] == 400
    assert push_bytes(servers.open, save(state), headers={"X-Run": ""})[0] == 400  # a push names its run
    assert version_of(servers.open) == before
    status, answer = generate(servers.open)
    assert status == 200 and max_diff(answer["outputs"], reference) < FP32_TOL


def test_bad_requests_get_4xx_and_the_server_keeps_serving(servers):
    port = servers.open
    good = {"prompt_ids": [4, 10], "n": 1, "max_tokens": 4}

    def post(body):
        return request(port, "POST", "/generate", body, {"Content-Type": "application/json"})[0]

    assert post(b"{not json") == 400
    assert post({"requests": []}) == 400
    assert post({"requests": [{**good, "prompt_ids": "abc"}]}) == 400
    assert post({"requests": [{**good, "prompt_ids": [4, 1.5]}]}) == 400
    assert post({"requests": [{**good, "prompt_ids": [4, 10_000]}]}) == 400  # outside the vocabulary
    assert post({"requests": [{**good, "prompt_ids": [-1]}]}) == 400
    assert post({"requests": [{**good, "prompt_ids": [4] * 512}]}) == 400  # no room left in max_model_len
    assert post({"requests": [{**good, "n": 0}]}) == 400
    assert post({"requests": [{**good, "n": 10**9}]}) == 413  # over --max-sequences: never handed to vLLM
    assert post({"requests": [{**good, "max_tokens": "8"}]}) == 400
    assert post({"requests": [good], "sampling": {"not_a_param": 1}}) == 400
    assert post({"requests": [good], "sampling": {"n": 4}}) == 400  # the server sets n itself
    assert post({"requests": [good], "sampling": {"temperature": "hot"}}) == 400
    assert post({"requests": [good], "weight_version": "1"}) == 400
    assert request(port, "GET", "/nowhere")[0] == 404
    assert request(port, "GET", "/generate")[0] == 405
    assert _raw(port, b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n") == 411  # no Content-Length
    big = b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n{}" % (2**40)
    assert _raw(port, big) == 413  # refused before reading: only two bytes were sent
    huge = b"POST /update_weights HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Run: a\r\nContent-Length: %d\r\n\r\nxx" % 2**36
    assert _raw(port, huge) == 413
    assert _raw(port, b"GET /health HTTP/1.1\r\nHost: rebound.example\r\n\r\n") == 403  # DNS rebinding
    assert request(port, "GET", "/health")[0] == 200
    assert post({"requests": [good], "sampling": {"structured_outputs": {"regex": "[a-z]+"}}}) == 200


def _raw(port, data: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        return int(s.makefile("rb").readline().split()[1])


def test_the_key_server_requires_its_key_except_on_health(servers, reference):
    port = servers.keyed
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        assert request(port, "GET", "/weight_version", headers=headers)[0] == 401
        assert generate(port, headers=headers)[0] == 401
        assert push(port, reference, headers=headers)[0] == 401
    assert request(port, "GET", "/weight_version")[0] == 401
    good = {"Authorization": f"Bearer {KEY}"}
    assert request(port, "GET", "/health")[0] == 200
    assert request(port, "GET", "/weight_version", headers=good) == (200, {"weight_version": 0, "run": None})
    status, answer = generate(port, headers=good)
    assert status == 200 and max_diff(answer["outputs"], reference) < FP32_TOL
    assert push(port, reference, "K", headers=good) == (200, {"weight_version": 1, "run": "K"})


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=server_env())


def _side_by_side(*commands: list[str]) -> list[subprocess.CompletedProcess]:
    """The commands' results, run at the same time (each a process of its own that mostly imports: one core)."""
    return side_by_side(*(lambda command=command: _run(command) for command in commands))


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "grpo", *args]


def test_binding_another_address_without_a_key_is_refused(vllm_model_dir):
    public, no_shards = _side_by_side(
        _cli("vllm-serve", "--model", vllm_model_dir, "--host", "0.0.0.0"),
        _cli("vllm-serve", "--model", vllm_model_dir, "--tensor-parallel-size", "0"),
    )
    assert public.returncode == 2
    assert "--api-key" in public.stderr and "GRPO_VLLM_API_KEY" in public.stderr and "0.0.0.0" in public.stderr
    assert no_shards.returncode == 2 and "--tensor-parallel-size must be at least 1" in no_shards.stderr


def test_a_tensor_parallel_server_samples_from_the_model_and_loads_pushed_weights_into_every_shard(
    vllm_model_dir, reference, tmp_path
):
    """--tensor-parallel-size 2: the model in two shards, each in a worker process of its own (each reads the
    pushed weights from the server's private file and keeps its part)."""
    proc = start(vllm_model_dir, tmp_path, "--kv-cache-gib", "0.05", "--tensor-parallel-size", "2")
    try:
        wait(proc, timeout=240)
        status, answer = generate(proc.port)
        assert status == 200 and max_diff(answer["outputs"], reference) < FP32_TOL
        perturbed = AutoModelForCausalLM.from_pretrained(vllm_model_dir, torch_dtype=torch.float32).eval()
        torch.manual_seed(2)
        with torch.no_grad():
            for p in perturbed.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        assert push(proc.port, perturbed, "tp") == (200, {"weight_version": 1, "run": "tp"})
        status, answer = generate(proc.port, version=1)
        assert status == 200
        assert max_diff(answer["outputs"], perturbed) < FP32_TOL
        assert max_diff(answer["outputs"], reference) > 100 * FP32_TOL
    finally:
        stop(proc)


def test_grpo_help_lists_vllm_serve():
    script = Path(sys.executable).parent / "grpo"  # the console script (pip install -e .)
    results = _side_by_side(_cli("--help"), *([[str(script), "--help"]] if script.exists() else []))
    for result in results:
        assert result.returncode == 0 and "vllm-serve" in result.stdout


def test_health_answers_while_a_generation_runs(servers):
    """The engine is behind a lock, the HTTP server is threaded: /health does not wait for the generation."""
    body = {
        "requests": [{"prompt_ids": [4, 10], "n": 32, "max_tokens": 400}],
        "sampling": {**sampling(400), "ignore_eos": True, "stop_token_ids": []},
    }
    worker = threading.Thread(target=request, args=(servers.open, "POST", "/generate", body))
    worker.start()
    time.sleep(0.5)
    began = time.monotonic()
    status = request(servers.open, "GET", "/health")[0]
    answered_during = worker.is_alive()
    elapsed = time.monotonic() - began
    worker.join()
    assert status == 200 and answered_during, f"/health took {elapsed:.1f} s"
