"""The GPU check's phases, run one after another, each in a process of its own under a time limit, inside one
deadline of at most 6 minutes (a lease's 15 device minutes then leave room to rerun): python bench/gpu_check.py
--out DIR [--dry-run]. scripts/gpu_check.sh is the command that runs it.

A phase that fails, crashes or runs out of time is recorded as such and the next one runs; a phase that would
start with too little time left is recorded as skipped. Everything lands in DIR:
- `results.jsonl`: one JSON object per line: each phase's status, start and time, and each measurement;
- `summary.md`: a short table of the phases and the headline figures (printed last, too);
- `logs.txt`: the end of each phase's output; `equivalence.log` and `trees.log`: the tests' whole output.

The phases, most valuable first (bench/gpu_phases.py says what each measures):
1. `basics` (versions, ceilings, sdpa: one process, one import of torch) and `equivalence`: CUDA correctness of
   decoding and log-probs, the tests marked `device` without FlexAttention (pytest --device cuda);
2. `decode`: the graphed step against the eager one, and the engine's loop across rollouts (captures, memory);
3. `model`, `grpo`, `trl`: grpo and TRL 1.16 end to end on the same random model of Qwen2.5-0.5B's shape (64 rows
   x 256 tokens, bf16, 3 steps, the first one a warm-up);
4. `train`: the tiled head and the training pass (one process);
5. `trees`: token trees on FlexAttention, one shape (its compilation is the cost);
6. `async`: grpo with async_generation (max_staleness 1) on the end-to-end workload, for `async_speedup`;
then `decode_inductor`, with what time is left: the graphed step compiled by Inductor before its capture against
the uncompiled one. The larger shapes and the layouts' timings (`layouts`) run only when asked (--phases). With
--dry-run the same phases run on the CPU at tiny sizes (a test runs it, so the script cannot rot between GPU loans).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

GIB = 2**30
SIZES = {
    "gpu": dict(
        shape="qwen2.5-0.5b",
        large_shape="qwen2.5-1.5b",
        large_decode_rows=[64, 256],
        copy_bytes=4 * GIB,
        matmul_n=8192,
        decode_rows=[64, 256],
        context=384,
        decode_steps=32,
        loop_tokens=256,
        head_rows=4096,
        rows=64,
        group=8,
        prompt=80,
        completion=256,
        steps=3,
        precision="bf16",
        default_copy_gb_per_s=4300.0,
        default_tflop_per_s=790.0,
        device="cuda",
        compile_backend="inductor",
        equivalence=[  # no FlexAttention: its compilation takes its own phase (trees)
            "tests/equivalence/test_lean_decode.py",
            "tests/equivalence/test_fast_generation.py",
            "tests/equivalence/test_shared_prefix_training.py",
            "tests/equivalence/test_static_decode.py",
        ],
        trees=[
            "tests/equivalence/test_tree_packing.py::test_tree_and_auto_passes_are_the_padded_pass_on_the_tests_device[ragged]"
        ],
        limit_scale=1.0,
    ),
    "dry": dict(
        shape="tiny",
        large_shape="tiny",  # the same: the dry run skips the larger shape's phases
        large_decode_rows=[4],
        copy_bytes=64 * 2**20,
        matmul_n=256,
        decode_rows=[2, 8],
        context=24,
        decode_steps=6,
        loop_tokens=8,
        head_rows=256,
        rows=8,
        group=4,
        prompt=12,
        completion=12,
        steps=2,
        precision="bf16",
        default_copy_gb_per_s=20.0,
        default_tflop_per_s=0.5,
        device="cpu",
        compile_backend="eager",  # the plumbing, not Inductor's C++ compilation on a small CPU
        equivalence=[
            "tests/equivalence/test_shared_prefix_training.py::test_chunked_logps_in_bfloat16_are_within_the_stated_tolerance"
        ],
        trees=[
            "tests/equivalence/test_tree_packing.py::test_tree_and_auto_passes_are_the_padded_pass_on_the_tests_device[ragged]"
        ],
        limit_scale=10.0,  # a small shared CPU, two phases at a time: the same order, the deadline for a limit
    ),
}
# (phase, seconds it may take at most), most valuable first; with pip and nvidia-smi the whole check stays within 6
# minutes (DEADLINE_S; scripts/gpu_check.sh). The deadline may leave a phase less.
PHASES = [
    ("basics", 20),  # versions, ceilings, sdpa: one process
    ("equivalence", 60),
    ("decode", 45),
    ("model", 15),
    ("grpo", 35),
    ("trl", 50),
    ("train", 25),  # the head and the training pass: one process
    ("trees", 35),
    ("async", 30),
    ("decode_inductor", 20),
]
OPTIONAL = [("layouts", 90), ("decode_large", 70), ("train_large", 45)]  # only with --phases
DEADLINE_S = 335
# the phases a phase waits for: those whose results it needs (the bounds it is measured against, the model it
# trains), and for the end-to-end runs each other (they share the bench's output directory)
AFTER = {
    **{p: ("basics",) for p in ("decode", "train", "decode_inductor", "decode_large", "train_large", "layouts")},
    "grpo": ("model",),
    "trl": ("model", "grpo"),
    "async": ("model", "grpo", "trl"),
}
SUBPHASES = {"basics": "versions,ceilings,sdpa", "train": "head,train"}  # gpu_phases.py's, in one process
TESTS = {"equivalence": "equivalence", "trees": "trees"}  # pytest phases: the sizes' list of tests, a log of their own
MIN_START_S = 15  # a phase needs at least this much time left to start
LOG_CHARS = 100_000  # the end of each phase's output kept in logs.txt
PREFIXES = ("GPU_RESULT ", "BENCH_RESULT ")


def command(phase: str, sizes: dict) -> list[str] | str:
    """The phase's command line, or why it is skipped."""
    py = sys.executable
    if phase in TESTS:
        return [
            py,
            "-m",
            "pytest",
            "-v",  # each test's outcome on its own line: what passed is known even if the phase runs out of time
            "-rf",
            "--tb=short",
            "-p",
            "no:cacheprovider",
            "-m",
            "device",
            "--device",
            sizes["device"],
            *sizes[TESTS[phase]],
        ]
    if phase in ("grpo", "trl", "async"):
        if phase == "trl" and importlib.util.find_spec("trl") is None:
            return "trl is not installed here (make gpu-wheels brings trl 1.16.0 for the GPU machine)"
        if not os.path.exists(os.path.join(sizes["model_dir"], "shape.json")):
            return "no model: the model phase did not finish"
        overrides = dict(
            model=sizes["model_dir"],
            dataset="random",
            per_device_train_batch_size=sizes["rows"],
            num_generations=sizes["group"],
            max_completion_length=sizes["completion"],
            max_steps=sizes["steps"],
            use_cpu=sizes["device"] == "cpu",
        )
        if phase == "async":
            overrides.update(async_generation=True, max_staleness=1)
        script = "run_trl.py" if phase == "trl" else "run_grpo.py"
        return [py, os.path.join(HERE, script), sizes["precision"], json.dumps(overrides)]
    if phase.endswith("_large"):
        if sizes["large_shape"] == sizes["shape"]:
            return "no larger shape here (the dry run's one shape ran in decode and train)"
        large = dict(sizes, shape=sizes["large_shape"], decode_rows=sizes["large_decode_rows"])
        return [py, os.path.join(HERE, "gpu_phases.py"), phase.removesuffix("_large"), json.dumps(large)]
    return [py, os.path.join(HERE, "gpu_phases.py"), SUBPHASES.get(phase, phase), json.dumps(sizes)]


def run_phase(phase: str, limit: float, sizes: dict) -> tuple[dict, list[dict], str]:
    """(status record, result records, output) of one phase."""
    cmd = command(phase, sizes)
    if isinstance(cmd, str):
        return {"phase": phase, "status": "skipped", "why": cmd}, [], ""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src"), HERE, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        output, code = done.stdout + done.stderr, done.returncode
        status = "ok" if code == 0 else "failed"
    except subprocess.TimeoutExpired as err:  # what it printed by then (bytes here, even with text=True)
        output, code, status = _text(err.stdout) + _text(err.stderr), None, "timeout"
    records = []
    for line in output.splitlines():
        for prefix in PREFIXES:
            if line.startswith(prefix):
                records.append({"phase": phase, **json.loads(line[len(prefix) :])})
    if phase in TESTS:
        records.append({"phase": phase, **pytest_counts(output), "name": phase})
    record = {"phase": phase, "status": status, "seconds": round(time.monotonic() - start, 1), "exit": code}
    if status != "ok":
        record["error"] = last_error(output)
    return record, records, output


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


_OUTCOMES = "passed|failed|error|errors|skipped|deselected"


def pytest_counts(output: str) -> dict:
    """The equivalence phase's counts and failed tests, from pytest's output (`-v`): its closing summary, or where it
    was stopped before one (out of time), each finished test's outcome line, and the test it was in (`running`)."""
    outcomes = re.findall(r"^(\S+\.py::.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", output, flags=re.M)
    failures = [node for node, outcome in outcomes if outcome in ("FAILED", "ERROR")]
    listed = re.findall(r"^(?:FAILED|ERROR) (\S+\.py::.*?)(?: - .*)?$", output, flags=re.M)  # -rf's summary
    failures += [node for node in listed if node not in failures]
    summaries = [line for line in output.splitlines() if re.search(rf"\d+ (?:{_OUTCOMES})\b.* in [\d.]+s", line)]
    if summaries:
        counts = {k: int(n) for n, k in re.findall(rf"(\d+) ({_OUTCOMES})\b", summaries[-1])}
        return {"name": "equivalence", **counts, "failures": failures}
    counts: dict = {}
    for _, outcome in outcomes:
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    last = output.rstrip("\n").rsplit("\n", 1)[-1].strip()
    running = last if re.fullmatch(r"\S+\.py::.*", last) else None  # the test started, not finished
    return {"name": "equivalence", **counts, "failures": failures, "running": running}


def last_error(output: str) -> str:
    """The last line that reads like an error (else the last line)."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"Error|Exception|error:|Killed|FAILED", line)]
    return (errors or lines or ["(no output)"])[-1][:300]


def headline(records: list[dict], sizes: dict) -> dict:
    """grpo against TRL, each phase against its floor, async_speedup: what the check is for."""
    by = {(r["phase"], r.get("name")): r for r in records}
    named = {r.get("name"): r for r in records}
    runs = {p: r for (p, name), r in by.items() if name is None and p in ("grpo", "trl", "async") and "tokens" in r}
    rate = {p: r["tokens"] / r["seconds"] for p, r in runs.items()}  # end-to-end tokens/s
    out = {}
    grpo, trl, overlapped = runs.get("grpo"), runs.get("trl"), runs.get("async")
    if grpo:
        out["grpo_tokens_per_s"] = rate["grpo"]
        out.update(against_floors(grpo, named.get("model"), named.get("ceilings"), sizes))
    if grpo and trl:
        out["trl_tokens_per_s"] = rate["trl"]
        out["speedup_vs_trl"] = rate["grpo"] / rate["trl"]
        key = "peak_device_gb" if "peak_device_gb" in grpo and "peak_device_gb" in trl else "peak_rss_gb"
        out["memory_vs_trl"] = grpo[key] / trl[key]
        out["peak_gb"] = {"grpo": grpo[key], "trl": trl[key], "measure": key}
    if grpo and overlapped:
        out["async_speedup"] = rate["async"] / rate["grpo"]
    for phase in TESTS:
        tests = by.get((phase, phase))
        if tests:
            out[phase] = f"{tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed"
    packages = named.get("packages")
    if packages and packages.get("transformers") != packages.get("transformers_pinned"):
        out["transformers"] = f"{packages.get('transformers')}, not the pinned {packages.get('transformers_pinned')}"
    return out


def against_floors(run: dict, model: dict | None, ceilings: dict | None, sizes: dict) -> dict:
    """The end-to-end run's decode step and training pass against their floors (after the warm-up step)."""
    from gpu_phases import Floors

    if not model:
        return {}
    floors = Floors({**sizes, "ceilings": ceilings or {}})
    keep = slice(1, None) if len(run["decode_steps"]) > 1 else slice(None)
    steps = sum(run["decode_steps"][keep])
    step_s = sum(run["generation_s"][keep]) / steps
    rows = sum(run["completion_tokens"][keep]) / steps
    floor = floors.decode(model, round(rows), sizes["prompt"] + sizes["completion"] // 2)
    pass_s, tokens = sum(run["train_pass_s"][keep]), sum(run["train_tokens"][keep])
    train_floor = 6 * model["parameters"] * tokens / floors.flops
    return {
        "decode_step_ms": 1e3 * step_s,
        "decode_floor_ms": 1e3 * floor,
        "decode_vs_bound": step_s / floor,
        "generation_tokens_per_s": run["generation_tokens_per_s"],
        "train_pass_ms": 1e3 * pass_s / len(run["train_pass_s"][keep]),
        "train_vs_bound": pass_s / train_floor,
        "training_tokens_per_s": tokens / pass_s,
    }


def figures(record: dict) -> str:
    """A phase's measurements in a few words."""
    skip = {"phase", "name"}
    out = []
    for key, value in record.items():
        if key in skip or isinstance(value, (list, dict)):
            continue
        out.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return " ".join(out)[:400]


def summary(statuses: list[dict], records: list[dict], lead: dict, dry: bool, seconds: float) -> str:
    lines = [
        f"# GPU check{' (dry run on the CPU)' if dry else ''}: {seconds:.0f} s",
        "",
        "| phase | status | s | figures |",
        "|---|---|---|---|",
    ]
    for status in statuses:
        phase = status["phase"]
        found = [r for r in records if r["phase"] == phase]
        text = "; ".join(f"{r.get('name') or phase}: {figures(r)}" for r in found) if found else ""
        if status["status"] != "ok":
            text = f"{status.get('error') or status.get('why', '')} {text}".strip()
        lines.append(f"| {phase} | {status['status']} | {status.get('seconds', '-')} | {text} |")
    lines += ["", "Headline: " + (json.dumps(lead, default=lambda x: round(x, 3)) if lead else "(none)")]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry-run", action="store_true", help="the same phases on the CPU, tiny sizes")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for every phase together")
    parser.add_argument("--phases", default=None, help="comma-separated subset of the phases")
    parser.add_argument(
        "--jobs", type=int, default=1, help="phases run at a time (the dry run's 2: timings on a GPU run alone)"
    )
    opts = parser.parse_args()
    os.makedirs(opts.out, exist_ok=True)
    sizes = dict(SIZES["dry" if opts.dry_run else "gpu"], model_dir=os.path.join(opts.out, "model"))
    if not opts.dry_run:
        sizes["model_dir"] = "/tmp/gpu-check-model"  # 2 GB: kept out of the folder that comes back
    wanted = opts.phases.split(",") if opts.phases else [p for p, _ in PHASES]
    phases = [(p, limit * sizes["limit_scale"]) for p, limit in PHASES + OPTIONAL if p in wanted]
    start = time.monotonic()
    statuses, records = [], []
    results = open(os.path.join(opts.out, "results.jsonl"), "w")
    logs = open(os.path.join(opts.out, "logs.txt"), "w")
    lock = threading.Lock()
    done: dict[str, threading.Event] = {phase: threading.Event() for phase, _ in PHASES + OPTIONAL}

    def run(phase: str, limit: float) -> None:
        taken = time.monotonic() - start  # when a worker took the phase up, in PHASES' order
        for before in AFTER.get(phase, ()):
            if before in wanted:
                done[before].wait()
        left = opts.deadline - (time.monotonic() - start)
        if left < MIN_START_S:
            status, found, output = {"phase": phase, "status": "skipped", "why": "out of time"}, [], ""
        else:
            status, found, output = run_phase(phase, min(limit, left), dict(sizes))
        status["taken"] = round(taken, 2)
        with lock:
            ceilings = [r for r in found if r.get("name") == "ceilings"]
            if ceilings:
                sizes["ceilings"] = ceilings[0]
            print(f"{phase}: {status['status']} ({status.get('seconds', 0)} s) {status.get('error', '')}", flush=True)
            statuses.append(status)
            records.extend(found)
            for record in [status, *found]:
                results.write(json.dumps(record, default=str) + "\n")
            results.flush()
            logs.write(f"===== {phase}: {status['status']}\n{output[-LOG_CHARS:]}\n")
            logs.flush()
            if phase in TESTS:  # the tests' whole output, tracebacks included
                with open(os.path.join(opts.out, f"{phase}.log"), "w") as f:
                    f.write(output)
        done[phase].set()

    # the phases in order, `jobs` at a time (a phase waits for the one it needs, which was started before it)
    with ThreadPoolExecutor(opts.jobs) as pool:
        for future in [pool.submit(run, phase, limit) for phase, limit in phases]:
            future.result()
    order = [phase for phase, _ in PHASES + OPTIONAL]
    statuses.sort(key=lambda status: order.index(status["phase"]))
    lead = headline(records, sizes)
    results.write(json.dumps({"phase": "headline", **lead}, default=str) + "\n")
    results.close()
    logs.close()
    text = summary(statuses, records, lead, opts.dry_run, time.monotonic() - start)
    with open(os.path.join(opts.out, "summary.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
