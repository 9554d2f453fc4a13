"""Server mode's weight push, measured (`make bench` runs it; figures in bench/RESULTS.md):

    python bench/push.py [--models bundled,qwen2.5-0.5b] [--dtype bfloat16] [--workload] [--wire-only] [--variants]
                         [--rounds 3]

For each model, the float32 policy's weights going to a server in `--dtype`, in bytes of the wire (the server's
dtype) per second, the best of 3 (`--rounds` for the copy and the wires, measured in turns: round by round, the
copy, then a push over each wire, so that a busy spell on a shared machine slows all of them, not one):
- `copy_bound`: one copy of the weights into preallocated tensors of the wire dtype, in this process, on one
  thread and on all cores: the faster (any transfer to another process must at least write every byte once);
- `http_body`: the path grpo's private server took until 2026-12-06: the weights serialized as one safetensors body,
  POSTed over loopback HTTP to another process, which reads and parses it (vLLM's load not included);
- `gloo_wire`: grpo's `gloo` weight-transfer engine's wire alone (`grpo.serve.gloo`), with the transport it picks
  (here, one host: the shared-memory ring): rank 0 here, a receiver process that gets each tensor in memory of its
  own, which it may keep, as a server's worker does;
- `gloo_tcp_wire`: the same over TCP (`GRPO_WEIGHTS_TRANSPORT=tcp`: the transport between hosts);
- `gloo_vllm`: the whole push into a real `grpo vllm-serve` (vLLM's own server, gloo backend) through
  `ServerEngine.sync_weights`: the weight version's requests, vLLM's start/update/finish round trip with its
  layerwise load and what grpo packs again on vLLM's CPU backend, the caches reset.
The line per model: `push_<model>: copy_bound_gb_s=... http_body_gb_s=... gloo_wire_gb_s=... gloo_tcp_wire_gb_s=...
gloo_vllm_gb_s=... gloo_vs_http=<gloo_wire / http_body> gloo_vs_copy_bound=<copy_bound / gloo_wire>
gloo_tcp_vs_copy_bound=<copy_bound / gloo_tcp_wire>`. `--wire-only`: copy_bound and the two wires alone.
`--variants`: the ring's variants on top, each as `gloo_wire` (slots of 8-64 MiB, 2 or 4 of them, the sender's cast
on 1 or 2 threads, the receiver on all cores, and the receiver handed views of the ring instead of copies: only for
a `load` that is done with them when it returns, which vLLM's is not). The receiver runs on the torch threads a vLLM
CPU worker gets (`WORKER_THREADS`: all cores but one, 1 here).

With `--workload`: the benchmark's workload (workload.py) on the bundled model in server mode against colocate
mode (`use_vllm=True`), end to end, each run in a fresh process; the server's start-up is outside the server-mode
run (it serves many runs), colocate's engine start-up is inside its run (as the harness counts it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from grpo.perf.allocator import keep_freed_memory  # noqa: E402
from grpo.rollout.weights import checkpoint_weights  # noqa: E402
from grpo.serve import gloo, messages, segment  # noqa: E402

REPEATS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def best_rate(nbytes: int, run, repeats: int = REPEATS) -> float:
    """The best of `repeats` runs' bytes per second (GB/s)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def wire_pairs(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    with checkpoint_weights(model) as weights:
        return list(weights)


def metadata(pairs, dtype):
    return [(n, dtype if t.is_floating_point() else t.dtype, tuple(t.shape)) for n, t in pairs]


class Sink(BaseHTTPRequestHandler):
    def do_POST(self):
        from safetensors.torch import load

        load(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def http_body(pairs, dtype) -> float:
    from safetensors.torch import save

    port = free_port()
    sink = subprocess.Popen([sys.executable, __file__, "--sink", str(port)])
    try:
        _wait_port(port)

        def push():
            body = save({n: t.to(dtype).contiguous() for n, t in pairs})
            request = urllib.request.Request(f"http://127.0.0.1:{port}/", data=body, method="POST")
            request.add_header("Content-Type", "application/octet-stream")
            urllib.request.urlopen(request).read()

        return best_rate(sum(messages.nbytes(m) for m in metadata(pairs, dtype)), push)
    finally:
        sink.kill()


# the receiver's torch threads: a vLLM CPU worker's (vLLM keeps one core for its other processes: 1 on 2 cores)
WORKER_THREADS = max(1, (os.cpu_count() or 1) - 1)
WIRES = {  # name: (transport, the receiver keeps its tensors, the receiver's threads, gloo's settings on the sender)
    "gloo_wire": ("auto", True, WORKER_THREADS, {}),
    "gloo_tcp_wire": ("tcp", True, WORKER_THREADS, {}),
}
VARIANTS = {  # the ring's, measured as gloo_wire
    "gloo_wire_slot8m": ("auto", True, WORKER_THREADS, dict(SLOT_BYTES=8 << 20)),
    "gloo_wire_slot16m": ("auto", True, WORKER_THREADS, dict(SLOT_BYTES=16 << 20)),
    "gloo_wire_slot64m": ("auto", True, WORKER_THREADS, dict(SLOT_BYTES=64 << 20)),
    "gloo_wire_2slots": ("auto", True, WORKER_THREADS, dict(SLOTS=2)),
    "gloo_wire_cast2threads": ("auto", True, WORKER_THREADS, dict(_CAST_THREADS=2)),
    "gloo_wire_receiver_all_threads": ("auto", True, os.cpu_count() or 1, {}),
    "gloo_wire_views": ("auto", False, WORKER_THREADS, {}),
}


@contextlib.contextmanager
def gloo_settings(settings: dict):
    """The wire's settings (`grpo.serve.gloo`'s, or the ring's in `grpo.serve.segment`) set for a variant."""
    owners = {name: segment if hasattr(segment, name) else gloo for name in settings}
    saved = {name: getattr(owners[name], name) for name in settings}
    try:
        for name, value in settings.items():
            setattr(owners[name], name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(owners[name], name, value)


def wires(pairs, dtype, contenders: dict, rounds: int = REPEATS) -> dict[str, float]:
    """`copy_bound` and each contender's wire (`WIRES`, `VARIANTS`: a receiver process each, connected first),
    GB/s, measured in turns: each round copies once on one thread and once on all (the bound: the faster), then
    pushes once over each wire; the best of `rounds` each. On a shared machine a busy spell then slows all of
    them, not one."""
    meta = metadata(pairs, dtype)
    nbytes = sum(messages.nbytes(m) for m in meta)
    links, receivers = {}, []
    try:
        for name, (transport, keep, threads, settings) in contenders.items():
            port = free_port()
            command = [sys.executable, __file__, "--receiver", str(port), json.dumps(_json_meta(meta)), transport]
            receivers.append(subprocess.Popen(command + [str(keep), str(threads), str(rounds)]))
            with gloo_settings(settings):
                links[name] = gloo.connect("127.0.0.1", port, 0, 2, "bench", 600, transport=transport)
            expected = "TCP" if transport == "tcp" else "shared memory"
            assert links[name].transport == expected, f"{name}: the link is {links[name].transport}, not {expected}"
        targets = [torch.empty(shape, dtype=d) for _, d, shape in meta]
        for target, (_, t) in zip(targets, pairs):
            target.copy_(t)  # first touch of the targets' pages, outside the timing
        best = {name: float("inf") for name in ["copy_bound", *contenders]}
        threads = torch.get_num_threads()
        for _ in range(rounds):
            for copy_threads in sorted({1, threads}):
                torch.set_num_threads(copy_threads)
                start = time.perf_counter()
                for target, (_, t) in zip(targets, pairs):
                    target.copy_(t)
                best["copy_bound"] = min(best["copy_bound"], time.perf_counter() - start)
            torch.set_num_threads(threads)
            for name, link in links.items():
                with gloo_settings(contenders[name][3]):
                    start = time.perf_counter()
                    gloo.send(link, pairs, meta)
                    best[name] = min(best[name], time.perf_counter() - start)
        return {name: nbytes / seconds / 1e9 for name, seconds in best.items()}
    finally:
        for link in links.values():
            link.shutdown()
        for receiver in receivers:
            receiver.wait(timeout=600)


def _json_meta(meta):
    return [(n, str(d).removeprefix("torch."), list(s)) for n, d, s in meta]


def gloo_vllm(model, tokenizer, model_dir: str, dtype: torch.dtype) -> float:
    from grpo.algo.sampling import SamplingSettings
    from grpo.rollout.remote import ServerEngine, ServerSettings

    port = free_port()
    server = start_server(model_dir, port, str(dtype).removeprefix("torch."), 0.2)
    try:
        sampling = SamplingSettings(max_completion_length=8, seed=0)
        servers = ServerSettings((f"http://127.0.0.1:{port}",), 600.0, group_port=free_port(), run_name="bench")
        accelerator = SimpleNamespace(is_main_process=True, num_processes=1, process_index=0)
        config = model.config.get_text_config()
        engine = ServerEngine(tokenizer, sampling, servers, [], accelerator, model.config, config.vocab_size)
        engine.sync_weights(model)  # connects
        nbytes = sum(messages.nbytes(m) for m in metadata(wire_pairs(model), dtype))
        return best_rate(nbytes, lambda: engine.sync_weights(model))
    finally:
        server.terminate()
        server.wait(timeout=60)


def start_server(model_dir: str, port: int, dtype: str, kv_cache_gib: float) -> subprocess.Popen:
    """`grpo vllm-serve` of the model (a 2048-token context), answering; its log: /tmp/grpo-bench-server-<port>.log."""
    log = open(f"/tmp/grpo-bench-server-{port}.log", "w")
    command = [sys.executable, "-m", "grpo", "vllm-serve", "--model", model_dir, "--port", str(port), "--dtype", dtype]
    command += ["--kv-cache-gib", str(kv_cache_gib), "--max-model-len", "2048"]
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: see {log.name}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return server
        except OSError:
            time.sleep(1)
    server.kill()
    raise RuntimeError(f"the server did not answer in 600 s: see {log.name}")


def _wait_port(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def model_dir_of(name: str) -> str:
    if name == "bundled":
        from grpo.models.bundled import bundled_model_path

        return bundled_model_path()
    import random_model

    path = os.path.join(os.environ.get("GRPO_CACHE", os.path.expanduser("~/.cache/grpo")), "bench", name)
    random_model.save(name, path)
    return path


def measure(
    name: str, dtype: torch.dtype, wire_only: bool = False, variants: bool = False, rounds: int = REPEATS
) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir_of(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    pairs = wire_pairs(model)
    measured = wires(pairs, dtype, {**WIRES, **(VARIANTS if variants else {})}, rounds)
    rates = {"copy_bound": measured.pop("copy_bound")}
    if not wire_only:
        rates["http_body"] = http_body(pairs, dtype)
    rates["gloo_wire"], rates["gloo_tcp_wire"] = measured.pop("gloo_wire"), measured.pop("gloo_tcp_wire")
    if not wire_only:
        rates["gloo_vllm"] = gloo_vllm(model, tokenizer, path, dtype)
    rates.update(measured)
    size = sum(messages.nbytes(m) for m in metadata(pairs, dtype)) / 1e9
    line = f"push_{name}: " + " ".join(f"{k}_gb_s={v:.2f}" for k, v in rates.items())
    if "http_body" in rates:
        line += f" gloo_vs_http={rates['gloo_wire'] / rates['http_body']:.2f}"
    line += f" gloo_vs_copy_bound={rates['copy_bound'] / rates['gloo_wire']:.2f}"
    line += f" gloo_tcp_vs_copy_bound={rates['copy_bound'] / rates['gloo_tcp_wire']:.2f}"
    return line + f" ({size:.2f} GB in {str(dtype).removeprefix('torch.')} a push)"


def workload(precision: str) -> str:
    """Server mode against colocate mode on the benchmark's workload (bundled model), end to end."""
    from harness import run

    dtype = "bfloat16" if precision == "bf16" else "float32"
    port = free_port()
    server = start_server(model_dir_of("bundled"), port, dtype, 1.0)
    try:
        server_mode = {"vllm_mode": "server", "vllm_server_base_url": f"http://127.0.0.1:{port}"}
        served = run("grpo+vllm", precision, {**server_mode, "vllm_server_timeout": 600})
        colocated = run("grpo+vllm", precision)
    finally:
        server.terminate()
        server.wait(timeout=60)
    return (
        f"server_vs_colocate={served['tokens_per_s'] / colocated['tokens_per_s']:.2f} (tokens/s end to end, "
        f"{precision}: server mode {served['tokens_per_s']:.1f}, colocate {colocated['tokens_per_s']:.1f}; "
        f"generation {served['generation_tokens_per_s']:.1f} against {colocated['generation_tokens_per_s']:.1f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="bundled,qwen2.5-0.5b")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--workload", choices=["bf16", "fp32"], help="also server mode against colocate")
    parser.add_argument("--sink", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--wire-only", action="store_true", help="the copy bound and the two wires alone")
    parser.add_argument("--variants", action="store_true", help="also the shared-memory ring's variants")
    parser.add_argument("--rounds", type=int, default=REPEATS, help="the wires' rounds (the best of them)")
    parser.add_argument("--receiver", nargs=6, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.sink:
        ThreadingHTTPServer(("127.0.0.1", opts.sink), Sink).serve_forever()
        return
    keep_freed_memory()  # as a trainer does (GRPOConfig.cpu_keep_freed_memory) and grpo vllm-serve's workers on CPUs
    if opts.receiver:
        port, meta = int(opts.receiver[0]), json.loads(opts.receiver[1])
        transport, keep, threads = opts.receiver[2], opts.receiver[3] == "True", int(opts.receiver[4])
        torch.set_num_threads(threads)
        meta = [(n, getattr(torch, d), tuple(s)) for n, d, s in meta]
        link = gloo.connect("127.0.0.1", port, 1, 2, "bench", 600, transport=transport)
        for _ in range(int(opts.receiver[5])):
            gloo.receive(link, meta, lambda done: None, keep=keep)
        link.shutdown()
        return
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    for name in opts.models.split(","):
        print(measure(name, getattr(torch, opts.dtype), opts.wire_only, opts.variants, opts.rounds), flush=True)
    if opts.workload:
        print(workload(opts.workload), flush=True)


if __name__ == "__main__":
    threading.excepthook = lambda args: None  # a sink thread's broken pipe at the end is not a result
    main()
