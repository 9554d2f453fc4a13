"""`grpo vllm-serve`'s checks that need no vLLM engine, and the trainer's client's checks of what a server answers.

- Who may ask (`grpo.serve.server_http`): a keyless server answers loopback Host names only (a DNS-rebinding page sends
  its own domain), never a web page's request (Origin), and bodies must carry their Content-Type.
- Weight versions belong to the server (`grpo.serve.server.Server`): each push gets the next number and names its run,
  so a run whose weights another run has replaced is refused; non-finite weights are never loaded.
- The client (`grpo.rollout.remote.ServerEngine`) checks every reply's shape, ids and counts, and names the server.
"""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch
from grpo.serve.server import Server
from grpo.serve.server_http import Access, Handler, RequestError, host_name
from safetensors.torch import save

import tiny
from grpo.rollout.base import Prompt, Request
from grpo.rollout.remote import ServerEngine, ServerError
from grpo.serve import server as server_module


class FakeApp:
    """Server's routes without an engine: what reached them."""

    def __init__(self) -> None:
        self.generated = 0

    def health(self) -> dict:
        return {"status": "ok"}

    def authorized(self, header: str | None) -> bool:
        return True

    def version_info(self) -> dict:
        return {"weight_version": 0, "run": None}

    def body_limit(self, path: str) -> int:
        return 2**20

    def generate(self, body: bytes) -> dict:
        self.generated += 1
        return {"outputs": []}


@pytest.fixture
def http_server():
    servers = []

    def start(allowed_hosts=None, keyed=False):
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        httpd.daemon_threads = True
        httpd.app, httpd.access = FakeApp(), Access(allowed_hosts, keyed)
        threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()  # a quick shutdown
        servers.append(httpd)
        return httpd

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


def ask(httpd, method="GET", path="/health", headers=None, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", httpd.server_address[1], timeout=30)
    try:
        conn.putrequest(method, path, skip_host=True)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def test_a_keyless_server_answers_only_loopback_host_names(http_server):
    httpd = http_server()
    port = httpd.server_address[1]
    for host in (f"127.0.0.1:{port}", "localhost", f"LOCALHOST:{port}", f"[::1]:{port}", "127.0.0.2", "0.0.0.0"):
        assert ask(httpd, headers={"Host": host})[0] == 200, host
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "10.0.0.1", "[::1].evil"):
        status, answer = ask(httpd, headers={"Host": host})
        assert status == 403 and "--allowed-hosts" in answer["error"], host
    assert ask(httpd, headers={})[0] == 403  # no Host at all
    body = json.dumps({"requests": []}).encode()
    rebinding = {"Host": "evil.example", "Content-Type": "application/json"}
    assert ask(httpd, "POST", "/generate", rebinding, body)[0] == 403
    assert httpd.app.generated == 0  # refused before any route ran


def test_a_web_pages_request_is_refused_even_on_loopback(http_server):
    httpd = http_server()
    headers = {"Host": "127.0.0.1", "Origin": "https://evil.example", "Content-Type": "application/json"}
    status, answer = ask(httpd, "POST", "/generate", headers, b"{}")
    assert status == 403 and "web pages" in answer["error"]
    assert ask(httpd, headers={"Host": "127.0.0.1", "Origin": "null"})[0] == 403
    assert httpd.app.generated == 0


def test_bodies_must_carry_their_content_type(http_server):
    httpd = http_server()
    for content_type in (None, "text/plain", "application/x-www-form-urlencoded"):  # what a page's form may send
        headers = {"Host": "127.0.0.1"} | ({"Content-Type": content_type} if content_type else {})
        status, answer = ask(httpd, "POST", "/generate", headers, b"{}")
        assert status == 415 and "application/json" in answer["error"]
    headers = {"Host": "127.0.0.1", "Content-Type": "application/json; charset=utf-8"}
    assert ask(httpd, "POST", "/generate", headers, b"{}")[0] == 200
    assert httpd.app.generated == 1


def test_allowed_hosts_and_a_key_open_other_names(http_server):
    named = http_server(allowed_hosts="trainer.internal, other.lan")
    assert ask(named, headers={"Host": "trainer.internal:8000"})[0] == 200
    assert ask(named, headers={"Host": "evil.example"})[0] == 403
    assert ask(named, headers={"Host": "127.0.0.1", "Origin": "http://other.lan:3000"})[0] == 200
    keyed = http_server(keyed=True)  # the key decides (a page cannot send it)
    assert ask(keyed, headers={"Host": "gpu-box.example"})[0] == 200
    assert ask(keyed, headers={"Host": "gpu-box.example", "Origin": "https://evil.example"})[0] == 403
    anything = http_server(allowed_hosts="*")
    assert ask(anything, headers={"Host": "evil.example", "Origin": "https://evil.example"})[0] == 200


def test_host_names_are_read_with_and_without_ports():
    assert host_name("Example.COM:80") == "example.com" and host_name("[::1]:8000") == "[::1]"
    assert host_name("::1") == "::1" and host_name("localhost") == "localhost"


# ---- weight versions, runs and finite weights (Server without an engine) --------------------------------------


@pytest.fixture
def engine_free_server(monkeypatch):
    """grpo.serve.server.Server with its checks and bookkeeping, an engine that records loads."""
    model = tiny.make_model(tiny.make_tokenizer(), 0)
    app = object.__new__(Server)
    app.model, app.lock, app.parallel, app.tied, app.dtype = "tiny", threading.Lock(), 1, False, torch.float32
    app.weight_version, app.pushes, app.run, app.llm = 0, 0, None, None
    app.shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    app.loads = []
    monkeypatch.setattr(server_module, "load_weights", lambda llm, weights, dtype, tied: app.loads.append(1))
    app.body = save({k: v.contiguous() for k, v in model.state_dict().items()})
    return app


def test_the_server_numbers_pushes_and_refuses_a_run_whose_weights_were_replaced(engine_free_server):
    app = engine_free_server
    assert app.update_weights(app.body, {"X-Run": "run A"}) == {"weight_version": 1, "run": "run A"}
    app._check_version(1, "run A")  # A's own weights: served
    assert app.update_weights(app.body, {"X-Run": "run B"}) == {"weight_version": 2, "run": "run B"}
    with pytest.raises(RequestError, match=r"version 2 \(pushed by run 'run B'\).*run 'run A'.*Another run") as err:
        app._check_version(1, "run A")
    assert err.value.status == 409
    with pytest.raises(RequestError, match="pushed by run 'run B'"):
        app._check_version(2, "run A")  # B's version number, claimed by A: refused too
    app._check_version(2, "run B")
    app._check_version(None, None)  # asks for nothing in particular (a plain client)
    assert app.version_info() == {"weight_version": 2, "run": "run B"}


def test_a_push_must_name_its_run_and_may_not_choose_its_version(engine_free_server):
    app = engine_free_server
    for headers in ({}, {"X-Run": ""}, {"X-Run": "x" * 201}, {"X-Run": "bad\x00name"}):
        with pytest.raises(RequestError, match="must name its run"):
            app.update_weights(app.body, headers)
    with pytest.raises(RequestError, match="numbers weight versions itself"):
        app.update_weights(app.body, {"X-Run": "A", "X-Weight-Version": "7"})
    assert app.loads == [] and app.version_info() == {"weight_version": 0, "run": None}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_before_loading(engine_free_server, bad):
    app = engine_free_server
    model = tiny.make_model(tiny.make_tokenizer(), 0)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    name = sorted(state)[3]
    state[name] = state[name].clone()
    state[name].view(-1)[0] = bad
    with pytest.raises(RequestError, match=f"{name} has NaN or infinite values"):
        app.update_weights(save(state), {"X-Run": "A"})
    assert app.loads == [] and app.version_info() == {"weight_version": 0, "run": None}


# ---- the client's checks of replies ---------------------------------------------------------------------------


class Scripted(BaseHTTPRequestHandler):
    """A server whose /generate answer the test sets (`server.reply(payload)` -> dict)."""

    def do_GET(self):
        self._json({"status": "ok", "dtype": "float32", "vocab_size": self.server.vocab, "weight_version": 0})

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/update_weights":
            self.server.pushes += 1
            return self._json({"weight_version": self.server.pushes, "run": self.headers["X-Run"]})
        self._json(self.server.reply(json.loads(body)))

    def _json(self, answer):
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted(tmp_path):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    httpd.daemon_threads, httpd.pushes, httpd.vocab = True, 0, 64
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()  # a quick shutdown
    tokenizer = tiny.make_tokenizer()
    args = SimpleNamespace(
        vllm_server_base_url=f"http://127.0.0.1:{httpd.server_address[1]}",
        vllm_server_timeout=10.0,
        vllm_server_api_key=None,
        max_completion_length=4,
        run_name=None,
        output_dir=str(tmp_path / "my-run"),
    )
    accelerator = SimpleNamespace(is_main_process=True, num_processes=1)
    engine = ServerEngine(tokenizer, args, [tokenizer.eos_token_id], accelerator, {"temperature": 1.0})
    yield httpd, engine
    httpd.shutdown()
    httpd.server_close()


def good_reply(payload):
    outputs = [[{"token_ids": [5, 6], "logprobs": [-1.0, None]}] * r["n"] for r in payload["requests"]]
    return {"weight_version": payload["weight_version"], "outputs": outputs}


REQUESTS = [Request(Prompt((4, 10, 11)), 2, 4), Request(Prompt((4, 20)), 1, 4)]


def test_a_good_reply_is_used_and_the_push_is_numbered_by_the_server(scripted):
    httpd, engine = scripted
    httpd.reply = good_reply
    engine.sync_weights(tiny.make_model(tiny.make_tokenizer(), 0))
    engine.sync_weights(tiny.make_model(tiny.make_tokenizer(), 0))
    assert engine.version == 2 and engine.run.startswith("my-run (")
    rollout = engine.generate(REQUESTS)
    assert rollout.completion_ids == [[5, 6]] * 3
    assert rollout.sampling_logps[0][0] == -1.0 and rollout.sampling_logps[0][1] != rollout.sampling_logps[0][1]


def _broken(change):
    def reply(payload):
        answer = good_reply(payload)
        change(answer)
        return answer

    return reply


BROKEN = {
    "no outputs": (lambda a: a.pop("outputs"), "no 'outputs' list"),
    "an output missing": (lambda a: a["outputs"].pop(), "1 outputs for 2 requests"),
    "a sample missing": (lambda a: a["outputs"][0].pop(), "1 samples for request 0, which asked for 2"),
    "an id past the vocabulary": (
        lambda a: a["outputs"][1].__setitem__(0, {"token_ids": [5, 64], "logprobs": [0.0, 0.0]}),
        r"outside the vocabulary \[0, 64\) in request 1",
    ),
    "a negative id": (
        lambda a: a["outputs"][1].__setitem__(0, {"token_ids": [-1], "logprobs": [0.0]}),
        "outside the vocabulary",
    ),
    "too many tokens": (
        lambda a: a["outputs"][1].__setitem__(0, {"token_ids": [5] * 5, "logprobs": [0.0] * 5}),
        "5 tokens in request 1, which allowed 4",
    ),
    "log-probs short": (
        lambda a: a["outputs"][0].__setitem__(1, {"token_ids": [5, 6], "logprobs": [0.0]}),
        "not one per token",
    ),
    "a string log-prob": (
        lambda a: a["outputs"][0].__setitem__(1, {"token_ids": [5], "logprobs": ["x"]}),
        "neither numbers nor null",
    ),
    "another version": (lambda a: a.__setitem__("weight_version", 7), "weight version 7 where this run's is 1"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_reply_that_is_not_what_was_asked_is_an_error_naming_the_server(scripted, case):
    httpd, engine = scripted
    change, message = BROKEN[case]
    httpd.reply = _broken(change)
    engine.sync_weights(tiny.make_model(tiny.make_tokenizer(), 0))
    with pytest.raises(ServerError, match=message) as err:
        engine.generate(REQUESTS)
    assert httpd.server_address and f"127.0.0.1:{httpd.server_address[1]}" in str(err.value)


def test_a_push_answer_without_this_runs_version_is_an_error(scripted):
    httpd, engine = scripted
    httpd.pushes = -1  # the server answers version 0: not a new push
    with pytest.raises(ServerError, match="not this run's new weight version"):
        engine.sync_weights(tiny.make_model(tiny.make_tokenizer(), 0))
