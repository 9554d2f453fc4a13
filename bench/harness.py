"""`make bench`: grpo against TRL 1.16 on one workload (workload.py), each run in a fresh process.

Throughput = completion tokens generated in all steps (EOS counted, padding not) / the wall time of the whole
training call (warm-up step included, model loading excluded), measured the same way for both. Peak memory is
the largest resident set of the run's whole process tree, sampled every 20 ms. The last line is
`speedup_vs_trl=<bf16 ratio> memory_vs_trl=<larger peak ratio> speedup_vs_trl_fp32=<fp32 ratio>
decode_vs_bound=<grpo fp32 decode step / memory bound> train_vs_bound=<grpo fp32 training pass / FLOP bound>`
(bounds.py), computed from the fast engine's rows. bfloat16 rows run only where bfloat16 is fast (grpo's own test:
AMX or AVX512-BF16 on a CPU); elsewhere the line starts at memory_vs_trl. `report_time_ratio` is the grpo run's time
(the first precision) with the run report over the same run
with run_report=False (two runs: noise of a few % either way), `report_share` the time its report builds took,
timed inside the run, over the run's time. Where vLLM is installed, a `grpo+vllm` bf16 row runs the same workload with
`use_vllm=True` (its engine's start-up counted in its time, its warm-up inside train()), and the line before gives
`vllm_generation_vs_fast=<generation tokens/s ratio> vllm_speedup_vs_trl=<end-to-end ratio>`. TRL's own colocate
mode is not run: on vLLM's CPU build it crashes at its first weight sync (docs/vllm.md). Two more grpo runs of 8 steps,
sequential and `async_generation` (max_staleness 1), give `async_speedup=<tokens/s ratio>` and the share of the
async run's time that the learner and the producer each spent waiting for the other, then `async_overlap_bound`:
the most overlap could give here, from each phase's time on its share of the cores against all of them. Then
`tree_positions_ratio`, `tree_pairs_ratio`, `tree_train_speedup` and `tree_train_speedup_checkpointing`:
packing="tree" against the padded layout on the micro-batches of a short run (tree_packing.py), and
`auto_train_speedup(_checkpointing)`: packing="auto" (each piece the cheaper layout) against the padded one.
`multi_turn_tree_vs_forked_tokens`, `multi_turn_tree_vs_appended_tokens` and `multi_turn_tree_speedup`: multi-turn
tool rollouts under a reasoning-stripping template, the tree against forked rows and append-only rows
(multi_turn_tree.py). `tree_images_positions_ratio`, `tree_images_vision_ratio` and `tree_images_speedup`: image rows
of a random Qwen2.5-VL, a random Qwen3-VL, a random Gemma 3 (image tokens that attend each other both ways) and a
random Gemma 4 (both ways in its sliding layers), as trees against padded rows, positions, images through the vision
tower, and the training pass's time (tree_images.py). Where vLLM is installed, server mode (push.py): per model (the
bundled one and a random Qwen2.5-0.5B), a line `push_<model>: copy_bound_gb_s http_body_gb_s gloo_wire_gb_s
gloo_tcp_wire_gb_s gloo_vllm_gb_s gloo_vs_http gloo_vs_copy_bound gloo_tcp_vs_copy_bound` (the weight push in bytes/s;
the wire through shared memory on one host, and over TCP), and `server_vs_colocate`, the workload end to end.
Per family the lean decoder is meant for (families.py: a random Qwen3-0.6B, a random Gemma 3, the bundled model with
LoRA adapters and without), a line `<family>: decode_tokens_s stepper_tokens_s decode_vs_bound vs_stepper`, the lean
decoder against the transformers forward it replaces, in float32; then `lora_end_to_end`: the workload with a LoRA
policy (r=16 on every linear layer), tokens/s end to end and the generation's tokens/s, the lean decoder against the
transformers forward (run_grpo.py's `lean: false`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import bounds
import psutil
from rich.console import Console
from rich.table import Table

HERE = os.path.dirname(os.path.abspath(__file__))
ASYNC = {"async_generation": True, "max_staleness": 1}


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc] + proc.children(recursive=True):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def overlap_bound(sync: dict, overlapped: dict) -> str:
    """What overlap can gain on this machine: each phase's time on its share of the cores (the async run) against
    all of them (the sequential run), medians over the steps after the first; async cannot beat the sequential
    step (generation + training pass) over the longer of the two phases on their shares."""

    def median(values: list) -> float:
        values = sorted(values[1:] or values)
        return values[len(values) // 2]

    g_all, t_all = median(sync["generation_s"]), median(sync["train_pass_s"])
    g_share, t_share = median(overlapped["generation_s"]), median(overlapped["train_pass_s"])
    return (
        f"async_overlap_bound={(g_all + t_all) / max(g_share, t_share):.2f} (generation {g_all:.2f} s on every core, "
        f"{g_share:.2f} s on the producer's share: x{g_share / g_all:.2f}; training pass {t_all:.2f} s against "
        f"{t_share:.2f} s on the learner's: x{t_share / t_all:.2f})"
    )


def run(framework: str, precision: str, overrides: dict | None = None) -> dict:
    script = "grpo" if framework == "grpo+vllm" else framework
    if framework == "grpo+vllm":
        overrides = {**(overrides or {}), "use_vllm": True}
    cmd = [sys.executable, os.path.join(HERE, f"run_{script}.py"), precision, json.dumps(overrides or {})]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    ps = psutil.Process(proc.pid)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            try:
                peak[0] = max(peak[0], tree_rss(ps))
            except psutil.Error:
                pass
            time.sleep(0.02)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    output = proc.stdout.read()
    proc.wait()
    done.set()
    watcher.join()
    lines = [line for line in output.splitlines() if line.startswith("BENCH_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{framework} {precision} failed (exit {proc.returncode}):\n{output[-3000:]}")
    result = json.loads(lines[-1][len("BENCH_RESULT ") :])
    result["framework"] = framework
    result["peak_gb"] = peak[0] / 1e9
    result["tokens_per_s"] = result["tokens"] / result["seconds"]
    return result


def table(results: list[dict], title: str) -> Table:
    t = Table(title=title)
    for col in (
        "framework",
        "precision",
        "tokens/s",
        "gen tokens/s",
        "train tokens/s",
        "seconds",
        "tokens",
        "peak GB",
        "engine",
        "CPU ISA",
    ):
        t.add_column(col)
    for r in results:
        t.add_row(
            r["framework"],
            r["precision"],
            f"{r['tokens_per_s']:.1f}",
            _fmt(r["generation_tokens_per_s"]),
            _fmt(r["training_tokens_per_s"]),
            f"{r['seconds']:.1f}",
            str(r["tokens"]),
            f"{r['peak_gb']:.2f}",
            r["engine"],
            r["isa"],
        )
    return t


def _fmt(x):
    return "-" if x is None else f"{x:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=["grpo", "trl"], help="run one framework (no ratios to TRL)")
    parser.add_argument("--full", action="store_true", help="also the scaling sweeps (make bench-full)")
    opts = parser.parse_args()
    console = Console(width=150)
    frameworks = [opts.only] if opts.only else ["grpo", "trl"]
    precisions = bounds.precisions()
    busy = os.getloadavg()[0]
    if busy > 0.5:  # measured here: two other busy processes on 2 cores made decode steps 4-10x slower
        console.print(
            f"warning: the load average is {busy:.1f} on {os.cpu_count()} cores before the benchmark "
            "starts; other processes' CPU time distorts every figure below (bounds included)"
        )
    if "bf16" not in precisions:
        console.print(
            "no fast bfloat16 here (no AMX or AVX512-BF16, or oneDNN capped below them): float32 rows "
            "only (emulated bfloat16 takes minutes a step for both frameworks)"
        )
    results = {}
    for precision in precisions:
        for framework in frameworks:
            console.print(f"running {framework} {precision} ...")
            results[(framework, precision)] = run(framework, precision)
    first = precisions[0]
    if opts.only in (None, "grpo"):
        # the run report's cost: the same run without report.html (run_report=False)
        console.print(f"running grpo {first} without the run report ...")
        results[("grpo, no report", first)] = dict(
            run("grpo", first, {"run_report": False}), framework="grpo, no report"
        )
    if opts.only in (None, "grpo"):
        # async_generation against the sequential loop: the same workload, longer (8 steps: 7 after the first,
        # which nothing overlaps), both on every core of the machine (async: one share each side)
        for name, extra in (("grpo, 8 steps", {}), ("grpo async, 8 steps", ASYNC)):
            console.print(f"running {name} {first} ...")
            results[(name, first)] = dict(run("grpo", first, {"max_steps": 8, **extra}), framework=name)
    if not opts.only and "bf16" in precisions and vllm_available():
        # the vLLM engine on the same workload (bf16); the ratios below stay the fast engine's
        console.print("running grpo+vllm bf16 ...")
        results[("grpo+vllm", "bf16")] = run("grpo+vllm", "bf16")
    console.print(table(list(results.values()), "grpo vs TRL 1.16 on the demo workload"))
    with open(os.path.join(HERE, "results.json"), "w") as f:
        json.dump([dict(r) for r in results.values()], f, indent=1)
    with_report, without = results.get(("grpo", first)), results.get(("grpo, no report", first))
    if with_report and without:
        print(
            f"report_time_ratio={with_report['seconds'] / without['seconds']:.3f} "
            f"(grpo {first} with report.html / without; 1.00 = no cost) report_share="
            f"{with_report['report_s'] / with_report['seconds']:.4f} ({with_report['report_builds']} builds "
            f"took {with_report['report_s']:.3f} s of the run's {with_report['seconds']:.1f} s)"
        )
    sync, overlapped = results.get(("grpo, 8 steps", first)), results.get(("grpo async, 8 steps", first))
    if sync and overlapped:
        print(
            f"async_speedup={overlapped['tokens_per_s'] / sync['tokens_per_s']:.2f} (grpo {first}, 8 steps, "
            f"max_staleness=1, tokens/s async / sequential) learner_wait_share="
            f"{overlapped['learner_wait_s'] / overlapped['seconds']:.2f} producer_wait_share="
            f"{overlapped['producer_wait_s'] / overlapped['seconds']:.2f} (time each side waited for the other)"
        )
        print(overlap_bound(sync, overlapped))
    against_bounds = {}
    if ("grpo", "fp32") in results:
        fp32 = results[("grpo", "fp32")]
        measured = bounds.machine(fp32["decode_weights"])
        against_bounds = bounds.ratios(fp32, measured)
        print(
            f"grpo fp32: decode step {against_bounds['decode_step_ms']:.1f} ms against "
            f"{against_bounds['decode_bound_ms']:.1f} ms to read the float32 weights once "
            f"({measured['read_gb_per_s']:.1f} GB/s, the best of 3 samples from "
            f"{measured['read_gb_per_s_low']:.1f}) and {against_bounds['decode_flop_bound_ms']:.1f} ms of "
            f"arithmetic at its {against_bounds['decode_rows_mean']:.1f} rows on average; "
            f"training pass at {against_bounds['train_vs_bound']:.2f}x "
            f"its FLOP bound ({measured['matmul_gflop_per_s']:.0f} GFLOP/s float32 matmul, the best of 3 from "
            f"{measured['matmul_gflop_per_s_low']:.0f}; {measured['threads']} threads)"
        )
    if opts.only in (None, "grpo"):
        # packing="tree" against the padded layout, on the micro-batches of a short run (tree_packing.py)
        console.print(f"running the training pass as token trees against padded ({first}) ...")
        tree = subprocess.run(
            [sys.executable, os.path.join(HERE, "tree_packing.py"), first], capture_output=True, text=True
        )
        print(tree.stdout.strip().splitlines()[-1] if tree.returncode == 0 else f"tree_packing failed: {tree.stderr}")
        # multi-turn tool rollouts under a reasoning-stripping template: the tree against forked rows
        console.print("running multi-turn rendered turns as token trees against forked rows ...")
        turns = subprocess.run(
            [sys.executable, os.path.join(HERE, "multi_turn_tree.py")], capture_output=True, text=True
        )
        print(
            turns.stdout.strip().splitlines()[-1]
            if turns.returncode == 0
            else f"multi_turn_tree failed: {turns.stderr}"
        )
        # image rows: a tree holds a group's prompt image once (tree_images.py)
        console.print("running image rows as token trees against padded rows ...")
        for architecture in ("qwen2.5-vl", "qwen3-vl", "gemma3", "gemma4"):
            command = [sys.executable, os.path.join(HERE, "tree_images.py"), "3", "224", architecture]
            images = subprocess.run(command, capture_output=True, text=True)
            ok = images.returncode == 0
            print(images.stdout.strip().splitlines()[-1] if ok else f"tree_images failed: {images.stderr}")
    if not opts.only:
        # the lean decoder on the families users train, against the transformers stepper (families.py)
        console.print("running the lean decoder on Qwen3, Gemma 3 and a LoRA policy (families.py) ...")
        families = subprocess.run([sys.executable, os.path.join(HERE, "families.py")], capture_output=True, text=True)
        lines = [
            line
            for line in families.stdout.splitlines()
            if line.split(":")[0] in ("qwen3", "gemma3", "lora", "bundled")
        ]
        print("\n".join(lines) if families.returncode == 0 else f"families failed: {families.stderr[-2000:]}")
        # a LoRA policy end to end (the workload, r=16 on every linear): the lean decoder's merged copy against the
        # transformers forward through PEFT's layers, each run in a fresh process
        lora = {}
        for name, lean in (("lean", True), ("stepper", False)):
            console.print(f"running grpo {first} with a LoRA policy, decoding through the {name} path ...")
            lora[name] = run("grpo", first, {"lora": 16, "learning_rate": 1e-4, "lean": lean})
        print(
            f"lora_end_to_end: tokens_s={lora['lean']['tokens_per_s']:.1f} "
            f"stepper_tokens_s={lora['stepper']['tokens_per_s']:.1f} "
            f"vs_stepper={lora['lean']['tokens_per_s'] / lora['stepper']['tokens_per_s']:.2f} "
            f"generation_vs_stepper="
            f"{lora['lean']['generation_tokens_per_s'] / lora['stepper']['generation_tokens_per_s']:.2f} "
            f"({first}, the workload with LoRA r=16 on every linear layer, warm-up step included)"
        )
    if not opts.only and vllm_available():
        # server mode: the weight push (gloo engine, HTTP body, copy bound) and the workload against colocate
        console.print("running server mode's weight push and workload (push.py) ...")
        push = subprocess.run(
            [sys.executable, os.path.join(HERE, "push.py"), "--workload", first], capture_output=True, text=True
        )
        lines = [line for line in push.stdout.splitlines() if line.startswith(("push_", "server_vs_colocate"))]
        print("\n".join(lines) if push.returncode == 0 else f"push failed: {push.stderr[-2000:]}")
    if opts.only:
        return
    speed = {p: results[("grpo", p)]["tokens_per_s"] / results[("trl", p)]["tokens_per_s"] for p in precisions}
    memory = max(results[("grpo", p)]["peak_gb"] / results[("trl", p)]["peak_gb"] for p in precisions)
    if opts.full:
        sweeps(console, first)
    if ("grpo+vllm", "bf16") in results:
        vllm, fast, trl = results[("grpo+vllm", "bf16")], results[("grpo", "bf16")], results[("trl", "bf16")]
        print(
            f"vllm_generation_vs_fast={vllm['generation_tokens_per_s'] / fast['generation_tokens_per_s']:.2f} "
            f"vllm_speedup_vs_trl={vllm['tokens_per_s'] / trl['tokens_per_s']:.2f}"
        )
    line = f"speedup_vs_trl={speed['bf16']:.2f} " if "bf16" in speed else ""
    line += f"memory_vs_trl={memory:.2f} speedup_vs_trl_fp32={speed['fp32']:.2f}"
    if against_bounds:
        line += (
            f" decode_vs_bound={against_bounds['decode_vs_bound']:.2f} "
            f"train_vs_bound={against_bounds['train_vs_bound']:.2f}"
        )
    print(line)


def vllm_available() -> bool:
    """Whether vLLM imports here (in a child process: importing it sets process-wide state)."""
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True)
    return probe.returncode == 0


SWEEPS = {
    # completions that run to the cap, 2 prompts x 8
    "max_completion_length": [{"dataset": "story", "max_completion_length": n, "max_steps": 3} for n in (64, 128, 256)],
    # 2 prompts per step, G completions each
    "num_generations": [
        {"num_generations": g, "per_device_train_batch_size": 2 * g, "max_steps": 3} for g in (4, 8, 16)
    ],
}


def step_time(result: dict) -> float:
    """Mean step time after the warm-up step."""
    times = [t for t in result["step_times"][1:] if t is not None]
    return sum(times) / len(times)


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def sweeps(console: Console, precision: str) -> None:
    """Step time against completion length and group size; prints grpo's slope / TRL's slope per sweep."""
    ratios = {}
    for name, settings in SWEEPS.items():
        t = Table(title=f"step time (s) vs {name}, {precision}")
        for col in ("framework", *[str(s[name]) for s in settings], "slope"):
            t.add_column(col)
        slopes = {}
        for framework in ("grpo", "trl"):
            console.print(f"sweep {name}: {framework} ...")
            times = [step_time(run(framework, precision, dict(s))) for s in settings]
            slopes[framework] = slope([s[name] for s in settings], times)
            t.add_row(framework, *[f"{x:.1f}" for x in times], f"{slopes[framework]:.4f}")
        console.print(t)
        ratios[name] = slopes["grpo"] / slopes["trl"]
    print(
        f"slope_ratio_length={ratios['max_completion_length']:.2f} "
        f"slope_ratio_generations={ratios['num_generations']:.2f}"
    )


if __name__ == "__main__":
    main()
