"""The measuring phases of the GPU check: python bench/gpu_phases.py PHASE[,PHASE...] SIZES_JSON (several phases
run in one process, one after another, sharing its imports; one that fails does not stop the next).

Each prints its results as `GPU_RESULT {json}` lines (bench/gpu_check.py collects them):
- `versions`: the GPU, the packages (transformers against the version constraints.txt pins), which
  scaled_dot_product_attention backends are on, native bfloat16;
- `ceilings`: device-to-device copy bandwidth (bytes read + written) and the bf16 matmul rate on random data;
- `sdpa`: which attention kernels accept the eager lean step's call (bfloat16, boolean mask, grouped key/value
  heads) and a prefill's, with grouped heads and repeated (the lean prompt pass on CUDA, transformers' training
  forward): "No available kernel" for the efficient kernel means the math fallback;
- `decode`: at several row counts (context ~ a prompt plus half a completion), against the step's floor, with
  kernel launches (graph launches apart) and host syncs per step: the fixed-shape step with its sampling
  (`grpo.rollout.graphed`, replayed from a CUDA graph; timed before any profiler runs, and run once with CUDA's
  sync debug mode set to error), the eager lean step it replaces, and the fast engine's whole loop per token
  (prefill, captures, row checks and read-back included) over `loop_tokens`-token completions, three rollouts on
  one engine: the graphs each captures (none after the first: they are kept for the run) and the memory reserved
  after each (it must not grow);
- `decode_inductor`: the fixed-shape step compiled by Inductor before its capture against the uncompiled one, on
  one segment (the largest row count), with the compilation's time;
- `head`: the tiled output head (`grpo.algo.logprobs`), forward and backward, at the device's tile and the CPU's;
- `train`: one training pass (grpo's forward with the shared prompt and tiled head, then backward) over a batch of
  the end-to-end run's shape, against 6 x weights x tokens at the measured matmul rate;
- `layouts` (asked for only: FlexAttention compiles for a minute): the training pass as padded rows, trees and
  packing="auto";
- `model`: builds and saves the end-to-end run's random model (bench/random_model.py).
Times are medians of CUDA-event (or, on the CPU, wall-clock) measurements after a warm-up.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

import random_model  # noqa: E402
import torch  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def emit(name: str, **values) -> None:
    print("GPU_RESULT " + json.dumps({"name": name, **values}, default=str), flush=True)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def median_s(fn, repeats: int, warmup: int = 2) -> float:
    """Median seconds of `fn()` over `repeats` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def counted(fn, calls: int = 1) -> dict:
    """Per call of `fn`: kernel launches and host syncs on CUDA; on the CPU, top-level aten operators."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync()
    events = prof.events()
    if CUDA:
        return {
            "launches": sum(e.name in LAUNCHES for e in events) / calls,
            "graph_launches": sum(e.name in GRAPH_LAUNCHES for e in events) / calls,
            "host_syncs": sum(e.name in SYNCS for e in events) / calls,
        }
    top = [e for e in events if e.name.startswith("aten::") and not (e.cpu_parent and "aten::" in e.cpu_parent.name)]
    return {"aten_ops": len(top) / calls}


def versions(sizes: dict) -> None:
    import importlib.metadata as md

    packages = {}
    for name in ("torch", "transformers", "accelerate", "datasets", "trl", "peft", "pyarrow", "fsspec", "math-verify"):
        try:
            packages[name] = md.version(name)
        except md.PackageNotFoundError:
            packages[name] = None
    with open(os.path.join(HERE, "..", "constraints.txt")) as f:
        pins = dict(line.strip().split("==", 1) for line in f if "==" in line and not line.startswith("#"))
    emit("packages", python=sys.version.split()[0], **packages, transformers_pinned=pins.get("transformers"))
    from grpo.models.modeling import fast_bf16_available

    info = {"device": str(DEVICE), "bf16_native": fast_bf16_available(DEVICE)}
    if CUDA:
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gb=props.total_memory / 1e9,
            multiprocessors=props.multi_processor_count,
            cuda=torch.version.cuda,
            flash_sdp=torch.backends.cuda.flash_sdp_enabled(),
            mem_efficient_sdp=torch.backends.cuda.mem_efficient_sdp_enabled(),
            cudnn_sdp=torch.backends.cuda.cudnn_sdp_enabled(),
            math_sdp=torch.backends.cuda.math_sdp_enabled(),
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        )
    emit("device", **info)


def ceilings(sizes: dict) -> None:
    n = sizes["copy_bytes"] // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=DEVICE)
    dst = torch.empty_like(src)
    copy_s = median_s(lambda: dst.copy_(src), repeats=10)
    m = sizes["matmul_n"]
    a, b = (torch.randn(m, m, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    matmul_s = median_s(lambda: a @ b, repeats=10, warmup=3)
    emit(
        "ceilings",
        copy_gb_per_s=2 * n * 2 / copy_s / 1e9,  # bytes read + written
        bf16_matmul_tflop_per_s=2 * m**3 / matmul_s / 1e12,
        copy_bytes=2 * n,
        matmul_n=m,
    )


def sdpa(sizes: dict) -> None:
    import torch.nn.functional as F  # noqa: N812
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shape = random_model.SHAPES[sizes["shape"]]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape["hidden_size"] // heads
    rows, context = sizes["decode_rows"][-1], sizes["context"]
    causal = torch.ones(context, context, dtype=torch.bool, device=DEVICE).tril()
    # (rows, queries, keys, mask, key/value heads): the fixed-shape decode step reads grouped heads with its own
    # two products, so its case is the eager lean step's; the lean prompt pass on CUDA and transformers' training
    # forward repeat the key/value heads before a masked call
    cases = {
        "decode": (rows, 1, context, torch.ones(rows, 1, 1, context, dtype=torch.bool, device=DEVICE), kv_heads),
        "prefill": (8, context, context, causal, kv_heads),
        "prefill_repeated": (8, context, context, causal, heads),
    }
    backends = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
    backends["math"] = "MATH"
    for case, (b, t, keys, mask, kv) in cases.items():
        q = torch.randn(b, heads, t, d, dtype=torch.bfloat16, device=DEVICE)
        k, v = (torch.randn(b, kv, keys, d, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
        mask = mask.expand(b, 1, t, keys)
        accepted = {}
        for short, name in backends.items():
            try:
                with sdpa_kernel([getattr(SDPBackend, name)]):
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv != heads)
                sync()
                accepted[short] = True
            except (RuntimeError, AttributeError) as err:
                # the first sentence ("No available kernel."); the reasons go to the log as torch's warnings
                accepted[short] = (str(err).strip() or type(err).__name__).split(". ")[0][:100]
        emit(f"sdpa_{case}", rows=b, queries=t, keys=keys, **accepted)


def _decoder_inputs(vocab: int, rows: int, context: int):
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(10, vocab, (rows, context), generator=g).to(DEVICE)
    return ids, torch.ones_like(ids), torch.arange(rows, device=DEVICE)


def _fixed(model, args, rows: int, ids, mask, owner, stop, compiled: str | None = None):
    """A fixed-shape rollout's loop, prefilled, graphed on CUDA (its own Graphs: the first advance warms up, the
    second captures), its step compiled with `compiled` (a torch.compile backend) before any capture."""
    from grpo.rollout.fast import logits_processors, sample_from
    from grpo.rollout.graphed import Graphs, StaticDecode
    from grpo.rollout.lean_decoder import LeanDecoder

    fixed = StaticDecode(
        LeanDecoder(model, torch.bfloat16),
        logits_processors(args),
        stop,
        sample_from,
        False,
        Graphs() if CUDA else None,
    )
    if compiled is not None:
        fixed.step_fn = torch.compile(fixed._step, backend=compiled, fullgraph=True, dynamic=False)
    fixed.prefill(ids, mask, owner, torch.full((rows,), 128, device=DEVICE), 128)
    return fixed


def _sync_free(step) -> bool | str:
    """Whether `step` runs with CUDA's sync debug mode set to error (a host sync inside it raises); on the CPU: True."""
    if not CUDA:
        step()
        return True
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        sync()
        return True
    except RuntimeError as err:
        return str(err).split("\n")[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def decode(sizes: dict) -> None:
    from grpo.algo.sampling import SamplingSettings
    from grpo.base.records import Prompt, group_requests
    from grpo.rollout.fast import FastEngine
    from grpo.rollout.lean_decoder import LeanDecoder

    model = random_model.make_model(sizes["shape"], str(DEVICE))
    measures = random_model.sizes_of(model)
    floor = Floors(sizes)
    tok = random_model.make_tokenizer(measures["vocab"])
    steps, context, loop_tokens = sizes["decode_steps"], sizes["context"], sizes["loop_tokens"]
    args = SamplingSettings(max_completion_length=loop_tokens, temperature=1.0)
    stop = torch.tensor([1], device=DEVICE)
    for rows in sizes["decode_rows"]:
        ids, mask, owner = _decoder_inputs(measures["vocab"], rows, context)
        # the fixed-shape step with its sampling, replayed from a CUDA graph (on the CPU: run eagerly), timed before
        # any profiler runs; then an eager step of it under the sync debug mode, and its launches counted
        fixed = _fixed(model, args, rows, ids, mask, owner, stop)
        step_s = median_s(fixed.advance, repeats=steps)  # the warm-up runs it, then captures it
        sync_free = _sync_free(fixed.step_fn)
        counts = counted(fixed.advance, calls=3)
        captured = fixed.graphs.captures if fixed.graphs is not None else 0
        del fixed
        # the eager step (the CPU's shrinking-batch loop)
        dec = LeanDecoder(model, torch.bfloat16)
        dec.prefill(ids, mask, owner, max_new=4 * steps + 8)
        tokens = torch.randint(10, measures["vocab"], (rows,), device=DEVICE)
        eager_s = median_s(lambda dec=dec, tokens=tokens: dec.step(tokens), repeats=steps)
        eager_counts = counted(lambda dec=dec, tokens=tokens: dec.step(tokens), calls=3)
        del dec
        bound = floor.decode(measures, rows, context + steps)
        # the engine's whole loop per token (prefill, graph captures, row checks and the read-back included), three
        # rollouts on one engine: graphs are kept for the run (captures after the first: none), memory must not grow
        engine = FastEngine(model, tok, args, [1], compute_dtype=torch.bfloat16)
        prompts = [Prompt(tuple(row)) for row in ids[: max(rows // 8, 1)].tolist()]
        requests = group_requests([p for p in prompts for _ in range(rows // len(prompts))])
        captures, reserved, seconds = [], [], []
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            rollout = engine.generate(requests)
            sync()
            seconds.append(time.perf_counter() - t0)
            captures.append(engine.graphs.captures - sum(captures))
            reserved.append(torch.cuda.memory_reserved() / 2**30 if CUDA else 0.0)
        loop_s = min(seconds[1:]) / max(max(len(c) for c in rollout.completion_ids), 1)
        loop_bound = floor.decode(measures, rows, context + loop_tokens // 2)
        emit(
            f"decode_{rows}_rows",
            rows=rows,
            context=context,
            step_ms=1e3 * step_s,
            floor_ms=1e3 * bound,
            step_vs_floor=step_s / bound,
            step_sync_free=sync_free,
            step_captures=captured,
            eager_step_ms=1e3 * eager_s,
            eager_vs_floor=eager_s / bound,
            graph_speedup=eager_s / step_s,
            loop_tokens=loop_tokens,
            loop_ms_per_token=1e3 * loop_s,
            loop_vs_floor=loop_s / loop_bound,
            loop_tokens_per_s=rows / loop_s,
            loop_captures=captures,  # per rollout: the first's, then none
            loop_reserved_gb=reserved,  # after each rollout: flat once the first has run
            loop_graphs_failed=engine.graphs.failed,
            **counts,
            **{f"eager_{k}": v for k, v in eager_counts.items()},
        )
        del engine


def decode_inductor(sizes: dict) -> None:
    """The graphed step compiled by Inductor before its capture, against the uncompiled graphed step: one segment at
    the largest row count (a compilation per (rows, width) in a run; here one)."""
    from grpo import GRPOConfig

    model = random_model.make_model(sizes["shape"], str(DEVICE))
    measures = random_model.sizes_of(model)
    rows, steps, context = sizes["decode_rows"][-1], sizes["decode_steps"], sizes["context"]
    args = GRPOConfig(output_dir="/tmp/gpu-check-engine", max_completion_length=128, temperature=1.0)
    stop = torch.tensor([1], device=DEVICE)
    ids, mask, owner = _decoder_inputs(measures["vocab"], rows, context)
    found = {}
    for name, backend in (("uncompiled", None), ("compiled", sizes["compile_backend"])):
        fixed = _fixed(model, args, rows, ids, mask, owner, stop, compiled=backend)
        sync()
        t0 = time.perf_counter()
        fixed.advance()  # the warm-up: the compilation, outside any capture (autotuning synchronizes)
        sync()
        first_s = time.perf_counter() - t0
        found[name] = median_s(fixed.advance, repeats=steps, warmup=1)  # the capture, then replays
        found[f"{name}_first_s"] = first_s
        found[f"{name}_graphs_failed"] = fixed.graphs.failed if fixed.graphs is not None else None
        del fixed
    emit(
        "decode_inductor",
        rows=rows,
        context=context,
        backend=sizes["compile_backend"],
        step_ms=1e3 * found["uncompiled"],
        compiled_step_ms=1e3 * found["compiled"],
        compiled_speedup=found["uncompiled"] / found["compiled"],
        compile_s=found["compiled_first_s"],
        graphs_failed=found["uncompiled_graphs_failed"],
        compiled_graphs_failed=found["compiled_graphs_failed"],
    )


class Floors:
    """The bounds, from the ceilings measured in this run (SIZES' `ceilings`, or the H200's figures)."""

    def __init__(self, sizes: dict) -> None:
        ceilings = sizes.get("ceilings") or {}
        self.read = ceilings.get("copy_gb_per_s", sizes["default_copy_gb_per_s"]) * 1e9  # bytes/s
        self.flops = ceilings.get("bf16_matmul_tflop_per_s", sizes["default_tflop_per_s"]) * 1e12

    def decode(self, measures: dict, rows: int, context: int) -> float:
        """A decode step's floor: the bf16 weights and every row's keys and values read once, or its
        arithmetic, whichever is longer."""
        read = 2 * measures["decode_weights"] + rows * context * measures["kv_bytes_per_token"]
        return max(read / self.read, 2 * measures["decode_weights"] * rows / self.flops)


def head(sizes: dict) -> None:
    from grpo.algo import logprobs
    from grpo.algo.logprobs import chunked_logps_and_entropy

    shape = random_model.SHAPES[sizes["shape"]]
    n, hidden, vocab = sizes["head_rows"], shape["hidden_size"], shape["vocab_size"]
    g = torch.Generator(DEVICE).manual_seed(0)
    x = torch.randn(n, hidden, device=DEVICE, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, device=DEVICE, generator=g) / hidden**0.5).requires_grad_()
    ids = torch.randint(0, vocab, (n,), device=DEVICE, generator=g)
    floor = 4 * 2 * n * hidden * vocab / Floors(sizes).flops  # forward, its recompute, two backward matmuls

    def run():
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            lp, ent = chunked_logps_and_entropy(x, w, None, ids, 1.0)
        (lp.sum() + ent.sum()).backward()

    # the CPU's cache-sized tile against the device's own (`logprobs.tile_bytes`)
    sized = logprobs.tile_bytes
    for label, tile in (("cpu", logprobs.TILE_BYTES), ("default", sized(DEVICE))):
        logprobs.tile_bytes = lambda device, tile=tile: tile
        try:
            seconds = median_s(run, repeats=5)
            counts = counted(run)
        finally:
            logprobs.tile_bytes = sized
        emit(
            f"head_{label}_tile",
            rows=n,
            vocab=vocab,
            tile_bytes=tile,
            ms=1e3 * seconds,
            floor_ms=1e3 * floor,
            vs_floor=seconds / floor,
            **counts,
        )


def _batch(prompts: list[list[int]], group: int, lengths: list[int], vocab: int, g: torch.Generator, truncated: bool):
    """A training batch on the device: `group` rows per prompt, random completions of `lengths`."""
    from grpo.base.records import Rollout
    from grpo.learner.batch import collate

    rollout = Rollout(
        prompt_ids=[p for p in prompts for _ in range(group)],
        completion_ids=[torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths],
        sampling_logps=[[0.0] * n for n in lengths],
        truncated=[truncated] * len(lengths),
    )
    return collate(rollout, torch.randn(len(lengths)), 0, mask_truncated=False).to(DEVICE)


def train(sizes: dict) -> None:
    from grpo.learner.forward import token_logps
    from grpo.learner.layouts import PassSettings

    model = random_model.make_model(sizes["shape"], str(DEVICE)).train()
    measures = random_model.sizes_of(model)
    rows, group, prompt, completion = sizes["rows"], sizes["group"], sizes["prompt"], sizes["completion"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, measures["vocab"], (prompt,), generator=g).tolist() for _ in range(rows // group)]
    batch = _batch(prompts, group, [completion] * rows, measures["vocab"], g, truncated=True)

    def run():
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            lp = token_logps(
                model, batch, PassSettings(1.0, with_entropy=True, chunked_head=True, layouts=("shared_prefix",))
            ).logps
        (lp * batch.mask).sum().backward()

    seconds = median_s(run, repeats=3, warmup=1)
    tokens = rows // group * prompt + rows * completion  # each group's prompt once, every completion token
    floor = 6 * measures["parameters"] * tokens / Floors(sizes).flops
    emit(
        "train_pass",
        rows=rows,
        tokens=tokens,
        ms=1e3 * seconds,
        floor_ms=1e3 * floor,
        vs_floor=seconds / floor,
        tokens_per_s=tokens / seconds,
        **counted(run),
    )


def layouts(sizes: dict) -> None:
    """The training pass over completions of a quarter to all of the cap (ragged, as a run's are) as padded rows,
    as token trees (packing="tree", with the kernel `tree_attention.attention_kernel` picks: FlexAttention where it
    compiles), as packing="auto" chooses per piece, and as the same trees under the dense mask: what decides
    whether "auto" becomes the default (bench/tree_packing.py measures the same on the CPU)."""
    from collections import Counter

    from grpo.learner import tree, tree_attention
    from grpo.learner.forward import token_logps
    from grpo.learner.layouts import PassSettings

    model = random_model.make_model(sizes["shape"], str(DEVICE)).train()
    g = torch.Generator().manual_seed(0)
    vocab, prompt = random_model.sizes_of(model)["vocab"], sizes["prompt"]
    prompts = [
        torch.randint(10, vocab, (prompt,), generator=g).tolist() for _ in range(sizes["rows"] // sizes["group"])
    ]
    reason = tree.unsupported_reason(model)
    if reason is not None:
        emit("train_layouts", skipped=reason)
        return
    rows, group, completion = sizes["rows"], sizes["group"], sizes["completion"]
    lengths = torch.randint(max(completion // 4, 1), completion + 1, (rows,), generator=g).tolist()
    batch = _batch(prompts, group, lengths, vocab, g, truncated=False)
    counts: Counter[str] = Counter()
    seconds, first = {}, {}
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        kernel = tree_attention.attention_kernel(model, DEVICE)  # "flex" where FlexAttention compiles here
    for name, kwargs, force in (
        ("padded", {}, None),
        ("tree", dict(layouts=("shared_prefix", "trees")), None),
        ("auto", dict(layouts=("shared_prefix", "trees"), by_cost=True), None),
        ("tree_dense", dict(layouts=("shared_prefix", "trees")), "dense"),  # the same trees under the dense mask
    ):
        tree_attention.FORCE_KERNEL = force
        settings = PassSettings(1.0, with_entropy=True, chunked_head=True, **{"layouts": ("shared_prefix",), **kwargs})

        def run(settings=settings):
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                scored = token_logps(model, batch, settings)
            counts.update(scored.layouts)
            (scored.logps * batch.mask).sum().backward()

        counts.clear()
        try:
            start = time.perf_counter()
            run()  # the first pass: with FlexAttention, its compilation (forward and backward) too
            if CUDA:
                torch.cuda.synchronize()
            first[name] = time.perf_counter() - start
            seconds[name] = median_s(run, repeats=3, warmup=0)
        finally:
            tree_attention.FORCE_KERNEL = None
        if name == "auto":
            auto_runs_trees = counts["trees"] > 0
    trees = tree.layout(batch, pair_cost=tree.pair_cost(model), kernel=kernel)
    emit(
        "train_layouts",
        rows=rows,
        completion_tokens=sum(lengths),
        kernel=kernel,
        padded_ms=1e3 * seconds["padded"],
        tree_ms=1e3 * seconds["tree"],
        auto_ms=1e3 * seconds["auto"],
        tree_dense_ms=1e3 * seconds["tree_dense"],
        tree_speedup=seconds["padded"] / seconds["tree"],
        auto_speedup=seconds["padded"] / seconds["auto"],
        tree_dense_speedup=seconds["padded"] / seconds["tree_dense"],
        # the first pass of each: FlexAttention's compilation shows here
        **{f"{name}_first_ms": 1e3 * value for name, value in first.items()},
        auto_runs_trees=auto_runs_trees,
        tree_positions=trees.positions_computed,
        tree_pairs=trees.pairs_computed,
    )


def model(sizes: dict) -> None:
    emit("model", path=sizes["model_dir"], **random_model.save(sizes["shape"], sizes["model_dir"], str(DEVICE)))


PHASES = {f.__name__: f for f in (versions, ceilings, sdpa, decode, decode_inductor, head, train, layouts, model)}


def main() -> None:
    """The phases named (comma-separated) one after another in this process; each one's failure is printed and the
    next one runs; the exit status says whether any failed."""
    import traceback

    sizes, failed = json.loads(sys.argv[2]), []
    for name in sys.argv[1].split(","):
        try:
            PHASES[name](sizes)
        except Exception:  # noqa: BLE001 (reported; the next phase runs)
            traceback.print_exc()
            print(f"RuntimeError: phase {name} failed", file=sys.stderr, flush=True)
            failed.append(name)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
