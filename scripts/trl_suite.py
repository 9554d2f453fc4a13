"""Run TRL's own GRPO test file against grpo (import swapped) and against TRL itself, on local stand-ins.

    python scripts/trl_suite.py PATH_TO_TRL_TESTS [--trainer grpo|trl|both] [--out DIR] [-- PYTEST_ARGS...]

PATH_TO_TRL_TESTS is the ``tests`` folder of a snapshot of TRL's repository (it holds ``test_grpo_trainer.py``,
``testing_utils.py``, ``conftest.py``, ``__init__.py``); TRL's source distribution does not ship its tests, so they
are read from there and never copied into this repository. TRL itself must be installed (``pip install -e .[bench]``
installs trl==1.16.0 beside grpo): the test file imports its helpers from ``trl``.

What changes between the two runs is one line: ``from trl import GRPOConfig, GRPOTrainer`` becomes
``from grpo import GRPOConfig, GRPOTrainer`` in the grpo run. Everything else is the same for both: the hub's tiny
models and the ``trl-internal-testing/zen`` datasets are replaced by local stand-ins (``scripts/trl_standins.py``),
found as directories of the same relative names from the working directory the tests run in; the hub is offline.

Prints one line per test (TRL's outcome, grpo's, and why where a test is not passed: `REASONS`) and the totals, and
writes ``results.json`` and ``table.md`` (the table in docs/trl.md) in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
IMPORT_LINE = "from trl import GRPOConfig, GRPOTrainer"
SUITE_FILES = ("__init__.py", "testing_utils.py", "conftest.py", "test_grpo_trainer.py")


def prepare(tests_dir: Path, work: Path, trainer: str) -> Path:
    """Copy TRL's test package to `work/<trainer>/tests`, swapping the trainer's import for grpo."""
    target = work / trainer / "tests"
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for name in SUITE_FILES:
        source = tests_dir / name
        if not source.exists():
            raise SystemExit(f"{source} is missing: pass the tests folder of a TRL repository snapshot")
        text = source.read_text()
        if name == "test_grpo_trainer.py" and trainer == "grpo":
            if IMPORT_LINE not in text:
                raise SystemExit(f"{source} has no line {IMPORT_LINE!r} to swap")
            text = text.replace(IMPORT_LINE, "from grpo import GRPOConfig, GRPOTrainer")
        if name == "testing_utils.py":
            text = _shim_import_utils(text)
        (target / name).write_text(text)
    return target / "test_grpo_trainer.py"


def _shim_import_utils(text: str) -> str:
    """The snapshot's testing_utils may import ``is_<package>_available`` helpers the installed TRL lacks (TRL's
    helpers move between releases): define each missing one as "the package is importable", for both runs."""
    import importlib

    block = re.search(r"from trl\.import_utils import \(([^)]*)\)", text)
    if block is None:
        return text
    import_utils = importlib.import_module("trl.import_utils")
    missing = [n for n in re.findall(r"is_\w+_available", block.group(1)) if not hasattr(import_utils, n)]
    if not missing:
        return text
    header = [
        "import importlib.util as _find",
        "import trl.import_utils as _trl_import_utils",
        "",
        *(
            f"_trl_import_utils.{n} = lambda: _find.find_spec({n[3:-10]!r}) is not None  # shim: absent in this TRL"
            for n in missing
        ),
        "",
    ]
    return "\n".join(header) + "\n" + text


def run(test_file: Path, standins: Path, junit: Path, pytest_args: list[str]) -> int:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    # datasets caches a local directory's data by its relative name: a cache of the stand-ins' own, rebuilt with them
    env["HF_DATASETS_CACHE"] = str(standins / "datasets-cache")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "pytest", str(test_file), "-p", "no:cacheprovider", "-q", "-rN"]
    command += [f"--junitxml={junit}", f"--rootdir={test_file.parent.parent}", *pytest_args]
    return subprocess.call(command, cwd=standins, env=env)


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, first line of the failure or skip message) from a junit XML file."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or "").strip().splitlines()[0][:160] if child.get("message") else ""
                break
        result[name] = (outcome, message)
    return result


# Why a test does not pass, by a part of its name: for TRL and grpo alike (the stand-ins), or for grpo alone (a
# deliberate difference, or a TRL-private attribute the test reads). Printed beside each such test.
REASONS = {
    "TestGRPORolloutDispatch::": "TRL-private: calls TRL's `_generate` on a hand-made object of TRL's private "
    "attributes (`_last_loaded_step`, `vllm_generation`, `_metrics`)",
    "test_iterable_eval_keeps_map_style_train_workers": "deliberate: grpo builds no DataLoader (rows are read by "
    "the trainer), so there is no `get_train_dataloader`/`get_eval_dataloader`",
    "test_liger_kernel_with_peft_lm_head_raises": "deliberate: `use_liger_kernel` has no effect in grpo (it warns), "
    "so a LoRA on lm_head trains and there is nothing to refuse",
    "test_liger_kernel_with_peft_": "TRL 1.16 fails these here: they expect Liger errors (ImportError without "
    "Liger, ValueError for prompt learning) that 1.16 does not raise; grpo's use_liger_kernel only warns",
    "test_entropy_bonus_flows_gradients": "TRL-private: reads `_entropy_bonus_enabled` and calls "
    "`_get_per_token_logps_and_entropies`",
    "test_prepare_input_called_with_correct_data": "TRL-private: patches the HF Trainer's `training_step`, which "
    "grpo's loop has not (TRL fails it here: the stand-in zen prompts are cut at other words than the hub's)",
    "test_train_with_multiple_environments": "TRL-private: reads `_env_tools` and `_environment_pool`",
    "test_train_with_tools_multimodal_response": "stand-ins: scripted completions in Qwen3.5's token ids (248046, "
    "...), outside every stand-in's vocabulary",
    "test_train_moe_peft_model": "TRL 1.16 fails it here (a 'ref' adapter left in the PEFT config)",
    "Gemma4": "stand-ins: Gemma 4's processor imports torchvision, which has no build for this torch",
}


def reason(name: str) -> str:
    return next((why for key, why in REASONS.items() if key in name), "")


def markdown(table: dict, trainers: tuple[str, ...]) -> str:
    """The table in docs/trl.md: every test not passed by both, with why."""
    lines = ["| test | " + " | ".join(trainers) + " | why |", "|---|" + "---|" * len(trainers) + "---|"]
    for name, cells in table.items():
        outcomes = [cells[t][0] for t in trainers]
        if all(o == "passed" for o in outcomes) or all(o == "skipped" for o in outcomes):
            continue
        why = reason(name) or next((cells[t][1] for t in reversed(trainers) if cells[t][0] != "passed"), "")
        lines.append(f"| `{name}` | " + " | ".join(outcomes) + f" | {why} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", type=Path, help="the tests folder of a TRL repository snapshot")
    parser.add_argument("--trainer", choices=("grpo", "trl", "both"), default="both")
    parser.add_argument("--out", type=Path, default=Path("runs/trl-suite"))
    parser.add_argument("--standins", type=Path, default=Path.home() / ".cache" / "grpo" / "trl-standins")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(HERE))
    import trl_standins

    standins = trl_standins.build(args.standins.resolve())
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    trainers = ("trl", "grpo") if args.trainer == "both" else (args.trainer,)
    results = {}
    for trainer in trainers:
        test_file = prepare(args.tests.resolve(), out, trainer)
        junit = out / f"{trainer}.xml"
        print(f"== TRL's test_grpo_trainer.py with the {trainer} trainer", flush=True)
        run(test_file, standins, junit, extra)
        results[trainer] = outcomes(junit)

    names = sorted(set().union(*results.values()))
    table = {name: {t: results[t].get(name, ("absent", "")) for t in trainers} for name in names}
    (out / "results.json").write_text(json.dumps(table, indent=1))
    (out / "table.md").write_text(markdown(table, trainers))
    for name in names:
        cells = "  ".join(f"{t}={table[name][t][0]:<7}" for t in trainers)
        note = reason(name) or next(
            (table[name][t][1] for t in reversed(trainers) if table[name][t][0] in ("failed", "error")), ""
        )
        print(f"{cells}  {name}  {note}")
    for t in trainers:
        counts = {k: sum(1 for v in results[t].values() if v[0] == k) for k in ("passed", "failed", "error", "skipped")}
        print(f"{t}: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + f" of {len(results[t])}")
    if len(trainers) == 2:
        both = sum(1 for n in names if all(table[n][t][0] == "passed" for t in trainers))
        trl_only = [n for n in names if table[n]["trl"][0] == "passed" and table[n]["grpo"][0] != "passed"]
        print(f"passed by TRL: {both + len(trl_only)}; by grpo among those: {both}; TRL-only: {len(trl_only)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
