"""Metrics: collected during a logging window, averaged, then shown live, appended to
`<output_dir>/metrics.jsonl` (one JSON object per logging step, carrying `step`) and sent to the trackers
accelerate knows (`report_to`). Only this module talks to trackers and the terminal."""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

SHOWN = ("reward", "loss", "completions/mean_length", "kl")


class MetricsLogger:
    """Per-window buffers of values; `log` reduces them (NaN-ignoring mean) and writes one row."""

    def __init__(self, output_dir: str | None, accelerator: Any, total_steps: int, show_progress: bool) -> None:
        self.accelerator = accelerator
        self.path = os.path.join(output_dir, "metrics.jsonl") if output_dir else None
        self.values: dict[str, list[float]] = defaultdict(list)
        self.is_main = accelerator.is_main_process
        self.console = Console(stderr=True)
        self.progress = None
        if show_progress and self.is_main:
            self.progress = Progress(TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                     TextColumn("<"), TimeRemainingColumn(), TextColumn("{task.fields[shown]}"),
                                     console=self.console, transient=False)
            self.task = self.progress.add_task("train", total=total_steps, shown="")

    def __enter__(self) -> MetricsLogger:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.stop()

    def add(self, name: str, value: float) -> None:
        self.values[name].append(float(value))

    def add_many(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.add(name, value)

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def log(self, step: int, epoch: float) -> dict[str, Any]:
        """Average the window, write the row, reset the window; returns the row."""
        row: dict[str, Any] = {"step": step, "epoch": round(epoch, 4)}
        for name, values in self.values.items():
            valid = [v for v in values if not math.isnan(v)]
            row[name] = sum(valid) / len(valid) if valid else None
        self.values.clear()
        if self.is_main:
            if self.path:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                with open(self.path, "a") as f:  # append: a resumed run never rewrites earlier rows
                    f.write(json.dumps(row) + "\n")
            if self.progress is not None:
                shown = "  ".join(f"{k.split('/')[-1]}={row[k]:.3g}" for k in SHOWN if row.get(k) is not None)
                self.progress.update(self.task, completed=step, shown=shown)
        trackable = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self.accelerator.trackers:
            self.accelerator.log(trackable, step=step)
        return row
