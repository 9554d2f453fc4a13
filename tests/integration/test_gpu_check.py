"""The prepared GPU check (scripts/gpu_check.sh, bench/gpu_check.py) cannot rot between GPU loans: its dry run
goes through every phase on this CPU at tiny sizes, in the order of their value, and a phase that fails or hangs is
recorded while the next one still runs; the whole check fits in 6 minutes, and the wheels it carries hold the
transformers the project pins."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "bench", "gpu_check.py"))
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def test_the_dry_run_goes_through_every_phase_and_writes_its_results(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    env.pop("GRPO_TEST_DEVICE", None)
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_check.sh"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    statuses = {r["phase"]: r["status"] for r in records if "status" in r}
    trl = "ok" if importlib.util.find_spec("trl") else "skipped"  # TRL comes with the bench extra only
    expected = {phase: "ok" for phase, _ in gpu_check.PHASES}
    assert statuses == dict(expected, trl=trl), (tmp_path / "logs.txt").read_text()[-4000:]
    # taken up in the order of their value (two at a time here: each no earlier than the one before it)
    taken = [next(r["taken"] for r in records if r.get("status") and r["phase"] == p) for p, _ in gpu_check.PHASES]
    assert taken == sorted(taken)
    names = {r.get("name") for r in records}
    for name in ("packages", "device", "ceilings", "sdpa_decode", "sdpa_prefill", "decode_2_rows", "decode_8_rows"):
        assert name in names
    assert {"head_default_tile", "head_cpu_tile", "train_pass", "model", "equivalence", "trees"} <= names
    for phase in ("equivalence", "trees"):
        tests = next(r for r in records if r.get("name") == phase)
        assert tests["passed"] >= 1 and not tests.get("failed") and not tests["failures"]
        assert " PASSED" in (tmp_path / f"{phase}.log").read_text()  # the whole output, in a file of its own
    decode = next(r for r in records if r.get("name") == "decode_8_rows")
    assert decode["step_ms"] > 0 and decode["floor_ms"] > 0 and decode["aten_ops"] > 0
    assert decode["step_sync_free"] is True and len(decode["loop_captures"]) == 3
    inductor = next(r for r in records if r.get("name") == "decode_inductor")
    assert inductor["step_ms"] > 0 and inductor["compiled_step_ms"] > 0
    packages = next(r for r in records if r.get("name") == "packages")
    assert packages["transformers_pinned"] == packages["transformers"]
    lead = records[-1]
    assert lead["phase"] == "headline"
    for key in ("grpo_tokens_per_s", "decode_vs_bound", "train_vs_bound", "async_speedup"):
        assert lead[key] > 0, lead
    if trl == "ok":
        assert lead["speedup_vs_trl"] > 0 and lead["memory_vs_trl"] > 0
    table = (tmp_path / "summary.md").read_text()
    assert table.startswith("# GPU check (dry run on the CPU)") and "| grpo | ok |" in table
    assert table.rstrip().splitlines()[-1].startswith("Headline: {")


def test_the_check_takes_at_most_six_minutes_in_the_order_of_its_value():
    """The GPU audit: the check took 10-11 of a lease's 15 device minutes, no rerun possible, and FlexAttention's
    compilations came before the end-to-end runs. Now: CUDA correctness first (without FlexAttention), then graph
    against eager decoding, grpo against TRL, the head and training pass, trees (one shape), async; the phases' limits
    fit the deadline, and the script's own timeout with pip and nvidia-smi stays within 6 minutes."""
    order = [phase for phase, _ in gpu_check.PHASES]
    assert order == [
        "basics",
        "equivalence",
        "decode",
        "model",
        "grpo",
        "trl",
        "train",
        "trees",
        "async",
        "decode_inductor",
    ]
    assert sum(limit for _, limit in gpu_check.PHASES) <= gpu_check.DEADLINE_S
    script = open(os.path.join(ROOT, "scripts", "gpu_check.sh")).read()
    timeout, deadline = re.search(
        r"timeout (\d+) \"\$py\" bench/gpu_check.py --out \"\$out\" --deadline (\d+)\n", script
    ).groups()
    assert int(deadline) == gpu_check.DEADLINE_S and int(timeout) <= 360 - 15  # pip and nvidia-smi: ~10 s
    gpu = gpu_check.SIZES["gpu"]
    assert not any("tree" in test for test in gpu["equivalence"])  # FlexAttention compiles in `trees` only
    assert len(gpu["trees"]) == 1 and "[" in gpu["trees"][0]  # one test, one shape
    assert gpu_check.command("basics", dict(gpu, model_dir="/x"))[2] == "versions,ceilings,sdpa"  # one process
    assert gpu_check.command("train", dict(gpu, model_dir="/x"))[2] == "head,train"


def test_the_gpu_wheels_carry_the_pinned_transformers():
    """The GPU image has transformers 5.17; the project pins 5.19 (constraints.txt): `make gpu-wheels` carries the
    pinned one (with the huggingface-hub it needs) and scripts/gpu_check.sh installs every carried wheel first on
    PYTHONPATH, and says when the transformers it then finds is not the pinned one."""
    pinned = re.search(r"^transformers==(\S+)$", open(os.path.join(ROOT, "constraints.txt")).read(), re.M).group(1)
    planned = subprocess.run(["make", "-n", "gpu-wheels"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert f"transformers=={pinned}" in planned and "huggingface-hub==" in planned
    script = open(os.path.join(ROOT, "scripts", "gpu_check.sh")).read()
    assert "--target /tmp/site .whl/*.whl" in script and 'export PYTHONPATH="/tmp/site' in script
    assert "not the pinned" in script


def test_a_failing_or_hanging_phase_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    scripts = {
        "versions": "import sys; print('ValueError: the phase broke', file=sys.stderr); sys.exit(3)",
        "ceilings": "import time; time.sleep(60)",
        "sdpa": 'print(\'GPU_RESULT \' + \'{"name": "sdpa_decode", "flash": true}\')',
    }
    monkeypatch.setattr(gpu_check, "command", lambda phase, sizes: [sys.executable, "-c", scripts[phase]])
    monkeypatch.setattr(gpu_check, "PHASES", [("versions", 30), ("ceilings", 2), ("sdpa", 30)])
    monkeypatch.setitem(gpu_check.SIZES["dry"], "limit_scale", 1.0)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--out", str(tmp_path), "--dry-run"])
    gpu_check.main()
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    statuses = [r for r in records if "status" in r]
    assert [(r["phase"], r["status"]) for r in statuses] == [
        ("versions", "failed"),
        ("ceilings", "timeout"),
        ("sdpa", "ok"),
    ]
    assert statuses[0]["exit"] == 3 and "ValueError: the phase broke" in statuses[0]["error"]
    assert {"phase": "sdpa", "name": "sdpa_decode", "flash": True} in records


def test_phases_that_would_start_after_the_deadline_are_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "command", lambda phase, sizes: [sys.executable, "-c", "pass"])
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--out", str(tmp_path), "--dry-run", "--deadline", "5"])
    gpu_check.main()
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {r["status"] for r in records if "status" in r} == {"skipped"}
    assert all(r["why"] == "out of time" for r in records if "status" in r)


def test_the_larger_shape_runs_the_same_phases():
    sizes = dict(gpu_check.SIZES["gpu"], model_dir="/nowhere")
    cmd = gpu_check.command("decode_large", sizes)
    assert cmd[2] == "decode"
    large = json.loads(cmd[3])
    assert large["shape"] == "qwen2.5-1.5b" and large["decode_rows"] == [64, 256]
    assert gpu_check.command("train_large", sizes)[2] == "train"
    assert "no larger shape" in gpu_check.command("decode_large", dict(gpu_check.SIZES["dry"], model_dir="/x"))


def test_the_equivalence_counts_survive_a_phase_that_runs_out_of_time():
    """pytest runs verbose: its closing summary gives the counts; where the phase was stopped before it, each
    finished test's outcome line does, and the test it was in is named."""
    lines = [
        "tests/unit/test_a.py::test_one PASSED                          [ 25%]",
        "tests/unit/test_a.py::test_two[gemma3-completion pictures] FAILED [ 50%]",
        "tests/unit/test_b.py::test_three SKIPPED (no GPU)              [ 75%]",
        "tests/unit/test_b.py::test_four[qwen3-vl] ",
    ]
    stopped = gpu_check.pytest_counts("\n".join(lines))
    assert stopped == {
        "name": "equivalence",
        "passed": 1,
        "failed": 1,
        "skipped": 1,
        "failures": ["tests/unit/test_a.py::test_two[gemma3-completion pictures]"],
        "running": "tests/unit/test_b.py::test_four[qwen3-vl]",
    }
    finished = lines[:3] + [
        "tests/unit/test_b.py::test_four[qwen3-vl] PASSED [100%]",
        "=========================== short test summary info ============================",
        "FAILED tests/unit/test_a.py::test_two[gemma3-completion pictures] - AssertionError: close",
        "============= 1 failed, 2 passed, 1 skipped, 3 deselected in 41.20s =============",
    ]
    assert gpu_check.pytest_counts("\n".join(finished)) == {
        "name": "equivalence",
        "failed": 1,
        "passed": 2,
        "skipped": 1,
        "deselected": 3,
        "failures": ["tests/unit/test_a.py::test_two[gemma3-completion pictures]"],
    }
