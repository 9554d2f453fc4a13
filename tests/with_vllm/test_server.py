"""`grpo vllm-serve`: vLLM's own server (`grpo.serve.launcher`) behind grpo's guard (`grpo.serve.guard`), spoken to
with real requests on the tiny head-size-32 Llama: it samples the model's own log-probs through /v1/completions,
has the weight-transfer engine the trainer needs, and keeps grpo's protections: a key on every route but /health
(vLLM's own key covers only /v1 and a few), no web page, no non-loopback Host without a key."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.rollout.server_client import ServerClient, token_counters
from support.served import KEY, request, server_env

FP32_TOL = 1e-3
PROMPTS = [[4, 10, 11, 12], [4, 20, 21]]
# vLLM's dev-mode routes that change weights, call workers or stop serving, and the routes that generate
DANGEROUS = [
    ("POST", "/collective_rpc", {"method": "get_model"}),
    ("POST", "/update_weights", {"update_info": {}}),
    ("POST", "/init_weight_transfer_engine", {"init_info": {}}),
    ("POST", "/start_weight_update", {}),
    ("POST", "/update_weight_version", {"new_version": "hijacked"}),
    ("POST", "/sleep", None),
    ("POST", "/pause", None),
    ("POST", "/reset_prefix_cache", None),
    ("GET", "/server_info", None),
    ("POST", "/v1/completions", {"model": "m", "prompt": [4, 10], "max_tokens": 2}),
    ("POST", "/inference/v1/generate", {"model": "m", "token_ids": [4, 10], "sampling_params": {"max_tokens": 2}}),
]


def completions(port, n=3, max_tokens=8, headers=None, model=None):
    body = {
        "model": model,
        "prompt": PROMPTS,
        "n": n,
        "max_tokens": max_tokens,
        "logprobs": 0,
        "temperature": 1.0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    return request(port, "POST", "/v1/completions", body, headers)


@torch.no_grad()
def model_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(completion)), torch.tensor(completion)]


def weights_from_disk(port: int) -> None:
    """Put the session server back on its model's saved weights: a run of test_server_mode.py pushes its trained
    ones (through the weight transfer) into the same server, and the cached prefixes hold their keys and values."""
    assert request(port, "POST", "/collective_rpc", {"method": "reload_weights"})[0] == 200
    assert request(port, "POST", "/reset_prefix_cache")[0] == 200


def test_the_server_samples_the_models_log_probs_and_has_the_weight_transfer(servers, vllm_model_dir):
    weights_from_disk(servers.open)
    status, answer = completions(servers.open, model=vllm_model_dir)
    assert status == 200, answer
    reference = AutoModelForCausalLM.from_pretrained(vllm_model_dir, torch_dtype=torch.float32).eval()
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert len(choices) == 6
    for i, choice in enumerate(choices):
        ids, logps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        assert choice["prompt_token_ids"] == PROMPTS[i // 3] and 1 <= len(ids) <= 8 and len(logps) == len(ids)
        assert (torch.tensor(logps) - model_logps(reference, PROMPTS[i // 3], ids)).abs().max() < FP32_TOL
    status, info = request(servers.open, "GET", "/server_info?config_format=json")
    assert status == 200 and info["vllm_config"]["weight_transfer_config"] == {"backend": "gloo"}
    assert info["vllm_config"]["model_config"]["logprobs_mode"] == "processed_logprobs"


def test_a_keyed_server_requires_its_key_on_every_route_but_health(servers):
    port = servers.keyed
    good = {"Authorization": f"Bearer {KEY}"}
    for method, path, body in DANGEROUS:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            status, answer = request(port, method, path, body, headers)
            assert status == 401, (path, headers, status, answer)
    assert request(port, "GET", "/health")[0] == 200
    assert request(port, "GET", "/weight_info", headers=good)[0] == 200
    assert completions(port, headers=good)[0] == 200
    assert completions(port, headers=good, max_tokens=1)[1]["choices"]  # the server kept serving


def test_a_keyless_server_answers_loopback_names_only_and_no_web_page(servers):
    port = servers.open
    version = request(port, "GET", "/weight_info")[1]["weight_version"]
    for method, path, body in DANGEROUS:
        for headers in ({"Host": "rebound.example"}, {"Host": "rebound.example:8000"}, {"Origin": "http://evil.test"}):
            status, answer = request(port, method, path, body, headers)
            assert status == 403, (path, headers, status, answer)
    # a page's "simple" request: a form post without a JSON body, and one with the Origin a browser adds
    assert _raw(port, b"POST /pause HTTP/1.1\r\nHost: rebound.example\r\nContent-Length: 0\r\n\r\n") == 403
    assert _raw(port, b"POST /pause HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: null\r\nContent-Length: 0\r\n\r\n") == 403
    assert request(port, "GET", "/weight_info")[1]["weight_version"] == version  # nothing reached the engine
    for host in ("localhost:1", "127.0.0.1", "[::1]:8000", "0.0.0.0:8000"):
        assert request(port, "GET", "/weight_info", headers={"Host": host})[0] == 200


def _raw(port, data: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        return int(s.makefile("rb").readline().split()[1])


# sampling parameters a hostile local process may send: each must be a 4xx, and the engine must serve on (one such
# request once wedged the private server's engine while /health kept answering)
HOSTILE = {
    "seed past 64 bits": {"seed": 2**70},
    "a float seed": {"seed": 1.5},
    "logit_bias past the vocabulary": {"logit_bias": {"99999999": 5}},
    "logit_bias negative": {"logit_bias": {"-3": 5}},
    "allowed_token_ids past the vocabulary": {"allowed_token_ids": [99999999]},
    "allowed_token_ids negative": {"allowed_token_ids": [-1]},
    "stop_token_ids past the vocabulary": {"stop_token_ids": [99999999]},
    "negative top_k": {"top_k": -5},
    "negative temperature": {"temperature": -1},
    "NaN temperature": {"temperature": float("nan")},
    "min_p above 1": {"min_p": 2},
    "min_tokens past max_tokens": {"min_tokens": 10**6},
    "max_tokens past the context": {"min_tokens": 5000, "max_tokens": 6000},
    "a bad regex": {"structured_outputs": {"regex": "(("}},
    "a bad JSON schema": {"structured_outputs": {"json": "{not json"}},
    "n past the limit": {"n": 10**6},
    "logprobs past the vocabulary": {"logprobs": 10**9},
    "top_p of 0": {"top_p": 0},
    "a lone surrogate in bad_words": {"bad_words": ["\ud800"]},
    "a lone surrogate in the prompt": {"prompt": "a\ud800b"},
    "an id past the vocabulary in the prompt": {"prompt": [99999999]},
}


@pytest.mark.parametrize("route", ["/v1/completions", "/inference/v1/generate"])
def test_hostile_sampling_parameters_get_a_4xx_and_the_engine_serves_on(servers, vllm_model_dir, route):
    base = {"max_tokens": 2, "logprobs": 0}

    def body(extra):
        if route == "/v1/completions":
            return {"model": vllm_model_dir, "prompt": PROMPTS[0], **base, **extra}
        sampling = {**base, "output_kind": 2, **{k: v for k, v in extra.items() if k != "prompt"}}
        return {"model": vllm_model_dir, "token_ids": extra.get("prompt", PROMPTS[0]), "sampling_params": sampling}

    answered = {}
    for name, extra in HOSTILE.items():
        if route != "/v1/completions" and isinstance(extra.get("prompt"), str):
            continue  # that route takes token ids only
        status, answer = request(servers.open, "POST", route, body(extra))
        answered[name] = status
        good, _ = request(servers.open, "POST", route, body({}))
        assert good == 200, f"after {name!r} ({status}: {answer}) the server no longer generates"
    assert all(400 <= status < 500 for status in answered.values()), answered


def test_the_engine_counts_its_tokens_for_the_trainers_progress_watch(servers, vllm_model_dir):
    """The trainer tells a wedged engine from a slow one by vLLM's token counters on /metrics (statistics on)."""
    before = token_counters(ServerClient(f"http://127.0.0.1:{servers.open}", 30, None).request_text("/metrics", 30))
    assert completions(servers.open, model=vllm_model_dir)[0] == 200
    after = token_counters(ServerClient(f"http://127.0.0.1:{servers.open}", 30, None).request_text("/metrics", 30))
    assert before is not None and after is not None and after[1] >= before[1] + 6 and after[0] > before[0]


def test_bad_flags_are_refused_before_vllm_starts(vllm_model_dir, capsys):
    from grpo import cli

    def refused(*flags: str) -> str:
        assert cli.main(["vllm-serve", "--model", vllm_model_dir, *flags]) == 2
        return capsys.readouterr().err

    public = refused("--host", "0.0.0.0")
    assert "--api-key" in public and "GRPO_VLLM_API_KEY" in public and "0.0.0.0" in public
    assert "--tensor-parallel-size" in refused("--tensor-parallel-size", "0")
    assert "--middleware" in refused("--middleware", "x.Y")
    with pytest.raises(SystemExit):
        cli.main(["vllm-serve", "--model", vllm_model_dir, "--weight-transfer-backend", "ipc"])
    assert "invalid choice" in capsys.readouterr().err


def test_the_grpo_command_lists_vllm_serve():
    script = Path(sys.executable).parent / "grpo"  # the console script (pip install -e .)
    command = [str(script)] if script.exists() else [sys.executable, "-m", "grpo"]
    result = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120, env=server_env())
    assert result.returncode == 0 and "vllm-serve" in result.stdout
