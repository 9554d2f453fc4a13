"""Server mode's checks that need no vLLM (tests/with_vllm has the real server):

- Who may ask (`grpo.serve.guard`, the middleware `grpo vllm-serve` installs in vLLM's server): with a key, every
  route but /health needs it; without one, only loopback Host names (a DNS-rebinding page sends its own domain);
  never a web page's request (Origin). A refused request never reaches the app.
- `grpo vllm-serve`'s command (`grpo.serve.launcher`): vLLM's module entry point with the trainer's flags.
- The client (`grpo.rollout.remote.ServerEngine`) against a scripted server that answers as vLLM does: every reply's
  counts, ids, lengths and log-probs are checked, as is the server's weight version before and after a generation,
  and a server without dev mode, without a weight-transfer engine, of another tokenizer or with a backend grpo does
  not drive is one error naming it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from grpo.algo.sampling import SamplingSettings
from grpo.base.records import Prompt, Request
from grpo.rollout.remote import ServerEngine, ServerError, ServerSettings, server_urls
from grpo.rollout.server_client import token_counters
from grpo.serve import launcher
from grpo.serve.guard import Access, Guard, host_name, lone_surrogate, past_the_context
from support import tiny

# ---- the guard --------------------------------------------------------------------------------------------------


def test_a_keyless_server_answers_only_loopback_host_names():
    access = Access([], None)
    for host in ("127.0.0.1:8000", "localhost", "[::1]:1", "0.0.0.0:8000", "127.1.2.3"):
        assert access.refusal("/update_weights", {"host": host}) is None, host
    for host in ("rebound.example", "rebound.example:8000", "10.0.0.2:8000", "[fe80::1]:80"):
        status, why = access.refusal("/pause", {"host": host})
        assert status == 403 and "not a loopback name" in why, host
    assert access.refusal("/health", {})[0] == 403  # no Host at all


def test_a_web_pages_request_is_refused_even_on_loopback():
    for origin in ("http://evil.test", "null", "http://127.0.0.1:8000"):
        status, why = Access([], None).refusal("/pause", {"host": "127.0.0.1", "origin": origin})
        assert status == 403 and "web pages" in why
    assert Access([], "app.example").refusal("/x", {"host": "app.example", "origin": "https://app.example"}) is None


def test_a_key_is_required_on_every_route_but_health_and_opens_other_host_names():
    access = Access(["s3cret"], None)
    for path in ("/update_weights", "/collective_rpc", "/v1/completions", "/server_info", "/sleep"):
        for header in (None, "Bearer wrong", "s3cret", "Basic s3cret"):
            headers = {"host": "10.0.0.2:8000", **({"authorization": header} if header else {})}
            assert access.refusal(path, headers)[0] == 401, (path, header)
        assert access.refusal(path, {"host": "10.0.0.2", "authorization": "Bearer s3cret"}) is None
    assert access.refusal("/health", {"host": "10.0.0.2"}) is None
    assert Access(["a", "b"], None).refusal("/x", {"host": "h", "authorization": "bearer b"}) is None


def test_host_names_are_read_with_and_without_ports():
    assert host_name("Example.COM:8000") == "example.com"
    assert host_name("[::1]:8000") == "[::1]" and host_name("[::1]") == "[::1]"
    assert host_name("localhost") == "localhost" and host_name("a:b:c") == "a:b:c"


def test_the_middleware_answers_a_refusal_itself_and_passes_the_rest_on(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope.get("path", scope["type"]))

    async def send(message):
        sent.append(message)

    guard = Guard(app)
    args = SimpleNamespace(api_key=["k"])
    for path, headers in (
        ("/update_weights", [(b"host", b"127.0.0.1")]),
        ("/update_weights", [(b"host", b"127.0.0.1"), (b"authorization", b"Bearer k")]),
        ("/health", [(b"host", b"127.0.0.1")]),
    ):
        scope = {
            "type": "http",
            "path": path,
            "headers": headers,
            "app": SimpleNamespace(state=SimpleNamespace(args=args)),
        }
        asyncio.run(guard(scope, None, send))
    assert reached == ["/update_weights", "/health"]
    assert sent[0]["status"] == 401 and b"API key" in sent[1]["body"]
    asyncio.run(guard({"type": "lifespan"}, None, send))  # not a request: passed on
    assert len(reached) == 3


def test_a_body_with_a_lone_surrogate_is_refused_and_others_reach_the_app_whole(monkeypatch):
    """vLLM answers a lone UTF-16 surrogate in `bad_words` with a 500 (measured): the guard refuses any JSON body
    holding one with a 400, and hands every other body on unchanged, however it was split."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    got, sent = [], []

    async def app(scope, receive, send):
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        got.append(b"".join(parts))

    async def send(message):
        sent.append(message)

    def post(*chunks):
        messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

        async def receive():
            return messages.pop(0)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"host", b"127.0.0.1")]}
        asyncio.run(Guard(app)(scope, receive, send))

    post(b'{"prompt": [1], "bad_words": ["\\ud800x"]}')
    assert got == [] and sent[0]["status"] == 400 and b"lone UTF-16 surrogate" in sent[1]["body"]
    post(b'{"prompt": "a pair \\ud83d\\ude00 ', b'and text"}')  # a surrogate pair is text (an emoji)
    post(b"not json \\ud800")  # vLLM's own parser answers that
    assert got == [b'{"prompt": "a pair \\ud83d\\ude00 and text"}', b"not json \\ud800"] and len(sent) == 2
    assert lone_surrogate(b'["\\uDC00"]') and lone_surrogate(b'{"a": {"b": ["\\ud800"]}}')
    assert lone_surrogate(b'{"k": "\\\\ud800"}') is None  # an escaped backslash, then the letters


def test_a_token_in_generation_past_the_context_is_refused():
    def ask(prompt, max_tokens):
        return json.dumps({"token_ids": prompt, "sampling_params": {"max_tokens": max_tokens}}).encode()

    assert past_the_context(ask([1, 2, 3], 62), 64)[0] == 400
    assert past_the_context(ask([1, 2, 3], 62), None) is None  # the server's context unknown: vLLM's to answer
    assert past_the_context(ask([1, 2, 3], 61), 64) is None and past_the_context(b"[1]", 64) is None


# ---- grpo vllm-serve's command ------------------------------------------------------------------------------------


def test_the_launcher_runs_vllms_module_with_the_trainers_flags(monkeypatch):
    for name in ("VLLM_CPU_OMP_THREADS_BIND", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"):  # a user's own wins
        monkeypatch.delenv(name, raising=False)
    args, extra = launcher.build_parser().parse_known_args(["--model", "m", "--max-num-seqs", "8"])
    argv, env = launcher.command(args, extra, cuda=False, cpus=[0, 1])
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # works under vllm-cpu (no `vllm` package)
    flags = dict(zip(argv, argv[1:]))
    assert json.loads(flags["--weight-transfer-config"]) == {"backend": "gloo"}
    assert flags["--host"] == "127.0.0.1" and flags["--middleware"] == "grpo.serve.guard.Guard"
    assert flags["--logprobs-mode"] == "processed_logprobs" and "--enable-scale-out" in argv
    assert "--enforce-eager" in argv and flags["--kv-cache-memory-bytes"] == str(2**30)
    assert argv[-2:] == ["--max-num-seqs", "8"] and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["MALLOC_MMAP_MAX_"] == "0"  # freed memory kept for reuse, as the trainer's CPU policy
    argv, _ = launcher.command(args, extra, cuda=True, cpus=[0, 1])
    assert json.loads(dict(zip(argv, argv[1:]))["--weight-transfer-config"]) == {"backend": "nccl"}
    assert "--enforce-eager" not in argv and "--kv-cache-memory-bytes" not in argv
    args = launcher.build_parser().parse_args(["--model", "m", "--tensor-parallel-size", "2", "--allowed-hosts", "h"])
    _, env = launcher.command(args, [], cuda=False, cpus=[0, 1, 2])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2" and env["GRPO_VLLM_ALLOWED_HOSTS"] == "h"


def test_binding_another_address_needs_a_key():
    public = launcher.build_parser().parse_args(["--model", "m", "--host", "0.0.0.0"])
    assert "--api-key" in launcher.startup_refusal(public, None)
    assert launcher.startup_refusal(public, "k") is None
    assert launcher.thread_binding([0, 1, 2, 3, 4], 2) == "0,1,2|3,4" and launcher.thread_binding([0], 2) == "nobind"


# ---- the client ---------------------------------------------------------------------------------------------------


class FakeVLLM(BaseHTTPRequestHandler):
    """Answers as vLLM's dev-mode server does; `server.completion(body)` makes a /v1/completions answer and
    `server.versions` are /weight_info's answers in turn (the last one repeated)."""

    def do_GET(self):
        path = self.path.split("?")[0]
        if path == "/health":
            return self._json({}, 503 if self.server.dead else 200)
        if path == "/server_info":
            if self.server.dev_mode is False:
                return self._json({"detail": "Not Found"}, 404)
            transfer = {"backend": self.server.backend} if self.server.backend else None
            model = {"model": "tiny", "dtype": "torch.float32", "max_model_len": 64}
            return self._json({"vllm_config": {"model_config": model, "weight_transfer_config": transfer}})
        if path == "/get_world_size":
            return self._json({"world_size": 1})
        if path == "/metrics":
            if self.server.tokens is None:  # statistics off: no vLLM counters
                return self._text("python_info 1.0\n")
            tokens = self.server.tokens()
            return self._text(
                f'vllm:prompt_tokens_total{{engine="0"}} 7.0\nvllm:generation_tokens_total{{}} {tokens}\n'
            )
        if path == "/weight_info":
            versions = self.server.versions
            return self._json({"weight_version": versions.pop(0) if len(versions) > 1 else versions[0]})
        self._json({"detail": "Not Found"}, 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        if self.path == "/tokenize":
            return self._json({"tokens": self.server.tokenize(body["prompt"])})
        if self.path == "/v1/completions":
            self.server.asked.append(body)
            if self.server.dies:  # the server goes away in the middle of the generation
                self.server.dead = True
                self.close_connection = True
                return
            if self.server.answers_after:  # (seconds) a slow generation, or a wedged engine's (never answered)
                time.sleep(self.server.answers_after)
            return self._json({"choices": self.server.completion(body)})
        self._json({})

    def _text(self, text):
        data = text.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _json(self, answer, status=200):
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def good_choices(body):
    return [
        {
            "index": i,
            "prompt_token_ids": body["prompt"],
            "token_ids": [5, 6],
            "logprobs": {"token_logprobs": [-1.0, None], "tokens": ["token_id:5", "token_id:6"]},
        }
        for i in reversed(range(body["n"]))  # any order: choices are read by index
    ]


@pytest.fixture
def fake():
    tokenizer = tiny.make_tokenizer()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeVLLM)
    httpd.daemon_threads, httpd.asked, httpd.versions = True, [], ["default"]
    httpd.dev_mode, httpd.backend, httpd.completion = True, "gloo", good_choices
    httpd.dies = httpd.dead = False
    httpd.answers_after, httpd.tokens = 0, lambda: 0
    httpd.tokenize = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    sampling = SamplingSettings(max_completion_length=4, seed=0)
    accelerator = SimpleNamespace(is_main_process=True, num_processes=1, process_index=0)
    model = tiny.make_model(tokenizer, 0)

    def engine(url=url, timeout=5.0):
        settings = ServerSettings(urls=(url,), timeout=timeout, run_name="my-run")
        stop = [tokenizer.eos_token_id]
        return ServerEngine(tokenizer, sampling, settings, stop, accelerator, model.config, 64)

    yield SimpleNamespace(httpd=httpd, engine=engine, model=model, url=url)
    httpd.shutdown()
    httpd.server_close()


REQUESTS = [Request(Prompt((4, 10, 11)), 2, 4), Request(Prompt((4, 20)), 1, 4)]


def test_a_good_reply_is_used_each_request_with_its_own_seed(fake):
    engine = fake.engine()
    rollout = engine.generate(REQUESTS)
    assert rollout.completion_ids == [[5, 6]] * 3 and rollout.prompt_ids[2] == [4, 20]
    assert rollout.sampling_logps[0][0] == -1.0 and rollout.sampling_logps[0][1] != rollout.sampling_logps[0][1]
    asked = sorted(fake.httpd.asked, key=lambda body: len(body["prompt"]))
    assert [body["n"] for body in asked] == [1, 2] and asked[0]["seed"] != asked[1]["seed"]
    assert all(body["logprobs"] == 0 and body["return_token_ids"] and body["model"] == "tiny" for body in asked)


def _broken(change):
    def reply(body):
        choices = good_choices(body)
        change(choices)
        return choices

    return reply


def _set(which, **fields):
    return lambda choices: choices[-1 - which].update(fields)  # good_choices lists them last first


BROKEN = {
    "a choice missing": (lambda c: c.pop(), "1 choices for 2 samples"),
    "numbered wrongly": (_set(1, index=5), "numbered other than 0..1"),
    "another prompt": (_set(0, prompt_token_ids=[9]), "another prompt than was sent for choice 0"),
    "an id past the vocabulary": (_set(1, token_ids=[5, 64]), r"outside the policy's vocabulary \[0, 64\) in choice 1"),
    "a negative id": (_set(0, token_ids=[-1, 5]), "outside the policy's vocabulary"),
    "too many tokens": (
        _set(0, token_ids=[5] * 5, logprobs={"token_logprobs": [0.0] * 5}),
        "5 tokens in choice 0, which allowed 4",
    ),
    "log-probs short": (_set(1, logprobs={"token_logprobs": [0.0]}), "not one per token in choice 1"),
    "a string log-prob": (_set(0, logprobs={"token_logprobs": ["x", 0.0]}), "log-prob of 'x' in choice 0"),
    "a log-prob of -Infinity": (_set(0, logprobs={"token_logprobs": [float("-inf"), 0.0]}), "log-prob of -inf"),
    "a log-prob of +Infinity": (_set(1, logprobs={"token_logprobs": [-1.0, float("inf")]}), "log-prob of inf in"),
    "a NaN log-prob": (_set(0, logprobs={"token_logprobs": [float("nan"), 0.0]}), "log-prob of nan"),
    "a positive log-prob": (_set(0, logprobs={"token_logprobs": [-0.5, 0.25]}), r"0.25 in choice 0.*at most 0"),
    "no choices": (lambda c: c.clear(), "0 choices for 2 samples"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_reply_that_is_not_what_was_asked_is_an_error_naming_the_server(fake, case):
    change, message = BROKEN[case]
    fake.httpd.completion = _broken(change)
    with pytest.raises(ServerError, match=message) as err:
        fake.engine().generate(REQUESTS)
    assert fake.url in str(err.value) and "nothing of it is used" in str(err.value)


def test_a_server_that_holds_other_weights_before_or_after_a_generation_is_refused(fake):
    engine = fake.engine()
    engine.version = "my-run (h pid 1) #3"
    fake.httpd.versions = ["other-run (h pid 2) #7"]
    with pytest.raises(ServerError, match=r"holds weight version 'other-run .*#7' before a generation"):
        engine.generate(REQUESTS)
    assert fake.httpd.asked == []  # never sampled from
    fake.httpd.versions = [engine.version, "other-run (h pid 2) #8"]  # pushed to meanwhile
    with pytest.raises(ServerError, match="after a generation.*nothing it sampled is used"):
        engine.generate(REQUESTS[:1])
    fake.httpd.versions = [engine.version]
    assert len(engine.generate(REQUESTS)) == 3


def test_a_server_without_dev_mode_or_weight_transfer_or_of_another_tokenizer_is_one_clear_error(fake):
    fake.httpd.dev_mode = False
    with pytest.raises(ServerError, match="VLLM_SERVER_DEV_MODE=1"):
        fake.engine()
    fake.httpd.dev_mode, fake.httpd.backend = True, None
    with pytest.raises(ServerError, match="no weight-transfer engine.*--weight-transfer-config"):
        fake.engine()
    fake.httpd.backend, fake.httpd.tokenize = "gloo", lambda text: [1, 2, 3]
    with pytest.raises(ServerError, match="serves tiny, whose tokenizer splits text differently"):
        fake.engine()


@pytest.mark.parametrize(("backend", "message"), [("ipc", "uses the 'ipc' weight-transfer engine"), ("nccl", "CUDA")])
def test_a_backend_grpo_does_not_drive_here_is_an_error_naming_it_before_anything_is_sent(fake, backend, message):
    fake.httpd.backend = backend
    engine = fake.engine()
    with pytest.raises(ServerError, match=message):
        engine.sync_weights(fake.model)


def test_no_server_at_the_url_is_an_error_naming_it_and_the_command_that_starts_one(fake):
    with pytest.raises(ServerError, match=r"No vLLM server answered at http://127.0.0.1:1 within .*grpo vllm-serve"):
        fake.engine(url="http://127.0.0.1:1", timeout=0.3)


def test_a_server_lost_in_a_generation_is_an_error_naming_it_within_the_timeout(fake):
    engine = fake.engine(timeout=1.0)
    fake.httpd.dies = True
    with pytest.raises(ServerError, match=rf"{fake.url} stopped answering during /v1/completions.*resume_from"):
        engine.generate(REQUESTS)


def test_a_generation_on_an_engine_that_makes_no_progress_is_an_error_though_health_answers(fake):
    """A wedged engine (one hostile request once did that) keeps /health answering: its token counters on /metrics
    standing still for vllm_server_timeout make the generation an error naming the server."""
    engine = fake.engine(timeout=1.0)
    fake.httpd.answers_after = 60
    with pytest.raises(ServerError, match=rf"{fake.url} answers /health, but its engine has produced no token"):
        engine.generate(REQUESTS)


def test_a_slow_generation_whose_engine_makes_progress_is_waited_for(fake):
    engine = fake.engine(timeout=1.0)
    fake.httpd.answers_after = 3  # three timeouts, while the counters move
    fake.httpd.tokens = time.monotonic_ns
    assert len(engine.generate(REQUESTS)) == 3


def test_without_counters_only_health_is_read(fake):
    engine = fake.engine(timeout=1.0)
    fake.httpd.answers_after, fake.httpd.tokens = 2.5, None  # statistics off: a long wait is not a stall
    assert len(engine.generate(REQUESTS)) == 3


def test_token_counters_are_summed_over_their_labels():
    page = 'vllm:prompt_tokens_total{engine="0"} 3.0\nvllm:prompt_tokens_total{engine="1"} 4.0\n'
    page += "# HELP vllm:generation_tokens_total x\nvllm:generation_tokens_total 5e+01\nvllm:prompt_tokens_created 9\n"
    assert token_counters(page) == (7.0, 50.0)
    assert token_counters("python_info 1.0\nvllm:prompt_tokens_total{} x\n") is None


def test_several_servers_come_as_a_list_or_comma_separated():
    def urls(given):
        return server_urls(given, "h", 1)

    assert urls(None) == ["http://h:1"]
    assert urls("http://a:1/, http://b:2") == urls(["http://a:1", "http://b:2"]) == ["http://a:1", "http://b:2"]
    with pytest.raises(ValueError, match="each once"):
        urls("http://a:1,http://a:1")


def test_the_examples_parse_and_use_real_flags():
    """examples/server_mode.sbatch is valid bash and its `grpo vllm-serve` and `accelerate launch` flags exist;
    examples/server_mode_train.py compiles."""
    import py_compile
    import re
    import shutil
    import subprocess
    from pathlib import Path

    examples = Path(__file__).resolve().parents[2] / "examples"
    script = (examples / "server_mode.sbatch").read_text()
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n", str(examples / "server_mode.sbatch")]).returncode == 0
    serve = re.search(r"^\s+grpo vllm-serve (.*?)&", script, re.M | re.S).group(1)
    flags = [word for word in serve.split() if word.startswith("--")]
    known = {option for action in launcher.build_parser()._actions for option in action.option_strings}
    assert flags and set(flags) <= known, set(flags) - known
    from accelerate.commands.launch import launch_command_parser

    launch = {option for action in launch_command_parser()._actions for option in action.option_strings}
    used = set(re.findall(r"(--[a-z_]+)", script.rsplit("accelerate launch", 1)[1]))
    assert {"--multi_gpu", "--num_machines", "--machine_rank", "--main_process_ip"} <= used <= launch, used - launch
    py_compile.compile(str(examples / "server_mode_train.py"), doraise=True)
