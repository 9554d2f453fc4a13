"""The run report: `<output_dir>/report.html`, one self-contained page that explains the run (what the diagnostics
found, the metrics against the step, sampled completions, the configuration and the package versions).

While training (`run_report=True`, the default), the main process writes it at logging steps and a last time when
train() ends, however it ends. Each write replaces the file atomically. The refresh has a bounded cost: a logging
step rebuilds the page only while the time spent building it so far, plus the next build's (estimated as the
last one's, FIRST_ESTIMATE seconds before any), stays within REFRESH_SHARE (2%) of the time since training
started; the last write always happens. A write that fails (full disk, a read-only file, a plotting error) is one
warning; training goes on.

`grpo report <output_dir>` (`rebuild`) writes the same page from the files the run left (`grpo.observe.report.record`),
for any run: running, finished, killed, resumed, or made before this page existed (without its configuration).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from grpo.models.modeling import model_name
from grpo.observe import diagnostics, run_dir
from grpo.observe.report import record
from grpo.observe.report.page import SHOWN_STEPS, Run, page, run_name

REPORT = "report.html"
REFRESH_SHARE = 0.02
FIRST_ESTIMATE = 0.1  # seconds a first build is expected to take (measured: 0.03 s for the demo's 36 steps)


class ReportError(ValueError):
    """`grpo report` was pointed at something that is not a run's output directory."""


def gather(
    output_dir: str,
    rows: list[dict[str, Any]],
    findings: list[diagnostics.Finding],
    status: tuple[str, str],
    skipped: int = 0,
    cache: dict | None = None,
) -> Run:
    """What the page shows: `rows` and `findings` as given, the rest read from output_dir (completions files read
    through `cache`, by path and modification time, when one is given)."""
    info = record.read_info(output_dir)
    last = max((r["step"] for r in rows), default=0)
    files = record.completion_files(output_dir, last)
    newest = list(files.items())[-SHOWN_STEPS:]
    shown = {step: _cached(cache, path, record.read_completions) for step, path in newest}
    if cache is not None:  # keep only what the page shows: a long run's older tables leave memory
        for key in [k for k in cache if k[0] not in {path for _, path in newest}]:
            del cache[key]
    return Run(
        name=run_name(output_dir),
        rows=rows,
        info=info,
        completions=shown,
        completion_steps=len(files),
        findings=findings,
        status=status[0],
        status_detail=status[1],
        skipped_lines=skipped,
        updated=record.now(),
    )


def _cached(cache: dict | None, path: str, read: Callable[[str], Any]) -> Any:
    if cache is None:
        return read(path)
    try:
        key = (path, os.stat(path).st_mtime_ns)
    except OSError:
        return read(path)
    if key not in cache:
        cache[key] = read(path)
    return cache[key]


def write(output_dir: str, run: Run, path: str | None = None) -> str:
    path = path or os.path.join(output_dir, REPORT)
    record.write_atomically(path, page(run))
    return path


def saved_status(output_dir: str, info: dict[str, Any]) -> tuple[str, str]:
    """How the run stands, from run_info.json and the run lock: running while a process holds the lock."""
    ended = info.get("ended")
    if not isinstance(ended, dict):
        ended = {}
    status = info.get("status")
    if run_dir.is_held(output_dir):
        return "running", "a grpo run holds this directory now; this page is a snapshot"
    if status in ("finished", "stopped"):
        return ended_status(status, ended)
    if status == "running":
        return "stopped", "the process ended without finishing (killed, or out of memory); resume it from a checkpoint"
    return "unknown", "no run_info.json: how the run ended is unknown"


def ended_status(outcome: str, ended: dict[str, Any]) -> tuple[str, str]:
    """The page's status line for a run that ended ("finished" or "stopped"), from run_info.json's "ended"."""
    detail = f"at step {ended.get('step')}, {ended.get('time')}"
    return outcome, detail if outcome == "finished" else f"{detail}: {ended.get('error')}"


def rebuild(output_dir: str, path: str | None = None) -> str:
    """`grpo report`: the page rebuilt from the run's files, the diagnostics replayed over its metrics; returns
    the path written."""
    if not os.path.isdir(output_dir):
        raise ReportError(f"{output_dir} is not a directory: pass a run's output_dir (where metrics.jsonl is).")
    metrics = record.read_metrics(output_dir)
    info = record.read_info(output_dir)
    if not metrics.rows and not info:
        raise ReportError(
            f"{output_dir} holds no metrics.jsonl rows and no run_info.json: it is not a grpo run's output_dir "
            "(or the run has not logged a step yet)."
        )
    limits = diagnostics.Limits.saved(record.saved_config(info, output_dir))
    found = diagnostics.Diagnosis(limits).replay(metrics.rows).findings
    run = gather(output_dir, metrics.rows, found, saved_status(output_dir, info), metrics.skipped)
    return write(output_dir, run, path)


def run_facts(model: Any, reward_names: list[str], tool_names: list[str], max_steps: int, processes: int) -> dict:
    """What run_info.json says of a run besides its configuration, starts and end: the model's name (`model`:
    the policy, unwrapped), the reward functions' and tools' names, the run's length and its processes."""
    return {
        "model": model.config._name_or_path or model_name(model),
        "reward_names": list(reward_names),
        "tools": tool_names,
        "max_steps": max_steps,
        "processes": processes,
    }


class RunReport:
    """The live report of one trainer: `running` around train(), `refresh` at each logging step. It writes in
    `output_dir`; `enabled`: run_report (the page; run_info.json is written either way); `facts`: what
    run_info.json says of the run besides its configuration, starts and end (`run_facts`)."""

    def __init__(
        self,
        output_dir: str,
        enabled: bool,
        facts: dict[str, Any],
        diagnosis: diagnostics.Diagnosis,
        is_main_process: bool,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.output_dir, self.facts, self.diagnosis, self.clock = output_dir, facts, diagnosis, clock
        self.main = is_main_process  # run_info.json is written whatever run_report says: `grpo report` reads it
        self.enabled = enabled and is_main_process
        self.started = clock()
        self.spent = 0.0  # seconds spent building the page so far
        self.estimate = FIRST_ESTIMATE  # the next build's cost: the last one's
        self.builds = 0
        self.failed = False
        self.cache: dict = {}
        self.state: Any = None

    @contextlib.contextmanager
    def running(self, state: Any, resumed_from: str | None, config: dict[str, Any]) -> Iterator[None]:
        """run_info.json at the start (with `config`, the run's configuration as `GRPOConfig.to_dict` gives it); at
        the end (any end) its outcome and the last page."""
        self.state, self.started = state, self.clock()
        self._safely(record.record_start, self.output_dir, config, self.facts, state.global_step, resumed_from)
        try:
            yield
        except BaseException as err:
            self._end(err)
            raise
        self._end(None)

    def _end(self, error: BaseException | None) -> None:
        ended = record.ending(self.state.global_step, error)
        self._safely(record.record_end, self.output_dir, ended)
        self.refresh(force=True, status=ended_status("finished" if error is None else "stopped", ended))

    def refresh(self, force: bool = False, status: tuple[str, str] | None = None) -> bool:
        """Rebuild the page when due (see the module docstring) or forced; returns whether it was written."""
        if not self.enabled or self.state is None:
            return False
        start = self.clock()
        if not force and self.spent + self.estimate > REFRESH_SHARE * (start - self.started):
            return False
        total = self.state.max_steps
        status = status or ("running", f"at step {self.state.global_step} of {total}; refreshed at logging steps")
        rows = list(self.state.log_history)
        ok = self._safely(self._write, rows, status)
        self.estimate = self.clock() - start
        self.spent += self.estimate
        self.builds += ok
        return ok

    def _write(self, rows: list[dict[str, Any]], status: tuple[str, str]) -> None:
        output_dir = self.output_dir
        write(output_dir, gather(output_dir, rows, self.diagnosis.findings, status, cache=self.cache))

    def _safely(self, fn: Callable, *args: Any) -> bool:
        if not self.main:
            return False
        try:
            fn(*args)
            return True
        except Exception as err:  # the report never stops a run
            if not self.failed:
                self.failed = True
                warnings.warn(
                    f"The run report ({os.path.join(self.output_dir, REPORT)}) could not be written "
                    f"({type(err).__name__}: {str(err)[:300]}); training goes on. Rebuild it later with `grpo report "
                    f"{self.output_dir}`, or set run_report=False.",
                    stacklevel=2,
                )
            return False
