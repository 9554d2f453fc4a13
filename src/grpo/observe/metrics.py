"""Metrics: collected during a logging window, averaged, then shown live, appended to
`<output_dir>/metrics.jsonl` (one JSON object per logging step, carrying `step`) and sent to the trackers
accelerate knows (`report_to`). With `log_completions`, the latest generation's completions are shown as a table
and written to `<output_dir>/completions/completions_<step>.parquet`. Only this module talks to trackers and the
terminal."""

from __future__ import annotations

import json
import math
import os
import random
import socket
import warnings
from collections import defaultdict, deque
from datetime import datetime
from typing import TYPE_CHECKING, Any

import accelerate.utils.imports as accelerate_imports
import torch
from accelerate.tracking import TensorBoardTracker, WandBTracker
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from grpo.algo.advantages import Advantages, nanstd
from grpo.config import ResolvedConfig
from grpo.config.validation import check_path_name
from grpo.models.vision import image_name

if TYPE_CHECKING:  # rounds is a layer above observe (tests/unit/test_boundaries.py): for the annotation only
    from grpo.rounds.groups import GenerationBatch

SHOWN = ("reward", "loss", "completions/mean_length", "kl")
WINDOW_MAX = ("sample/staleness_max",)  # logged as the window's maximum (every other metric: its mean)
TOTAL = "total:"  # the key prefix of a running total in the logger's state_dict


class MetricsLogger:
    """Per-window buffers of values; `log` reduces them (NaN-ignoring mean) and writes one row. Running totals
    (`set_total`, e.g. tokens seen) are no window's: every row carries their latest value."""

    def __init__(self, output_dir: str | None, accelerator: Any, total_steps: int, show_progress: bool) -> None:
        self.accelerator = accelerator
        self.path = os.path.join(output_dir, "metrics.jsonl") if output_dir else None
        self.values: dict[str, list[float]] = defaultdict(list)
        self.totals: dict[str, float] = {}
        self.is_main = accelerator.is_main_process
        self.console = Console(stderr=True)
        self.progress = None
        if show_progress and self.is_main:
            self.progress = Progress(
                TextColumn("[bold]GRPO"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("<"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[shown]}"),
                console=self.console,
                transient=False,
            )
            self.task = self.progress.add_task("train", total=total_steps, shown="")

    def __enter__(self) -> MetricsLogger:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()

    def state_dict(self) -> dict[str, list[float]]:
        """The unfinished logging window's values and the running totals (a checkpoint keeps them), as names
        with lists of numbers."""
        return {**{k: list(v) for k, v in self.values.items()}, **{TOTAL + k: [v] for k, v in self.totals.items()}}

    def load_state_dict(self, window: dict[str, list[float]]) -> None:
        self.values.clear()
        self.values.update({k: list(v) for k, v in window.items() if not k.startswith(TOTAL)})
        self.totals = {k[len(TOTAL) :]: v[-1] for k, v in window.items() if k.startswith(TOTAL) and v}

    def resume(self, step: int) -> None:
        """Continue a run at `step`: rows a killed run wrote after it leave metrics.jsonl (they will be written
        again)."""
        if self.is_main and self.path and os.path.exists(self.path):
            with open(self.path) as f:
                rows = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
            with open(self.path, "w") as f:
                f.writelines(rows)
        self.advance(step)

    def add(self, name: str, value: float) -> None:
        self.values[name].append(float(value))

    def add_many(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.add(name, value)

    def set_total(self, name: str, value: float) -> None:
        self.totals[name] = value

    def discard(self) -> None:
        """Drop the window unlogged (logging_strategy="no": no row will ever average it)."""
        self.values.clear()

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def log(self, step: int, epoch: float) -> dict[str, Any]:
        """Average the window, write the row, reset the window; returns the row."""
        row: dict[str, Any] = {"step": step, "epoch": round(epoch, 4)}
        for name, values in self.values.items():
            valid = [v for v in values if not math.isnan(v)]
            mean = sum(valid) / len(valid) if valid else None
            if name in WINDOW_MAX and valid:  # a maximum over the window, not a mean
                mean = max(valid)
            row[name] = mean if mean is None or math.isfinite(mean) else None  # metrics.jsonl stays valid JSON
        row.update(self.totals)
        self.values.clear()
        self.write_row(row)
        if self.is_main and self.progress is not None:
            shown = "  ".join(f"{k.split('/')[-1]}={row[k]:.3g}" for k in SHOWN if row.get(k) is not None)
            self.progress.update(self.task, completed=step, shown=shown)
        return row

    def write_row(self, row: dict[str, Any]) -> None:
        """A row (with "step") to metrics.jsonl (main process) and the trackers; evaluations write theirs so."""
        if self.is_main and self.path:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "a") as f:  # append: a resumed run never rewrites earlier rows
                f.write(json.dumps(row, allow_nan=False) + "\n")
        trackable = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self.accelerator.trackers:
            self.accelerator.log(trackable, step=row["step"])


# how each tracker takes the run's name (accelerate passes the project as its first argument)
RUN_NAME_KWARG = {"wandb": "name", "trackio": "name", "mlflow": "run_name", "swanlab": "experiment_name"}
UNNAMED_RUNS = ("comet_ml", "clearml", "aim", "dvclive")  # no run name grpo can pass through accelerate
DEFAULT_PROJECT = "huggingface"  # TRL's `project`, and transformers' wandb project when WANDB_PROJECT is unset


def tracker_init_kwargs(run_name: str | None) -> dict[str, dict[str, str]]:
    """accelerate's per-tracker `init_kwargs` naming the run (None: each tracker names it, as in transformers)."""
    return {} if run_name is None else {tracker: {kwarg: run_name} for tracker, kwarg in RUN_NAME_KWARG.items()}


def tensorboard_run_dir(project: str, run_name: str | None) -> str:
    """The TensorBoard run's directory under output_dir: `<project>/<run_name>`; an unnamed run gets the HF
    Trainer's default name, `<month><day>_<time>_<host>`. Names that would lead out of output_dir ('..', an
    absolute path) are refused as `GRPOConfig` refuses them: here too for a config changed after it was built."""
    check_path_name("project", project)
    check_path_name("run_name", run_name)
    return os.path.join(project, run_name or datetime.now().strftime("%b%d_%H-%M-%S") + "_" + socket.gethostname())


def _own_tracker(tracker: Any, args: ResolvedConfig, logging_dir: str) -> Any:
    """The tracker accelerate would make, or grpo's where accelerate's defaults differ from transformers': a
    TensorBoard run directory per run, and wandb's WANDB_PROJECT while `project` is left at its default."""
    if str(tracker) == "tensorboard":
        return TensorBoardTracker(tensorboard_run_dir(args.project, args.run_name), logging_dir)
    if str(tracker) == "wandb" and args.project == DEFAULT_PROJECT and os.environ.get("WANDB_PROJECT"):
        return WandBTracker(os.environ["WANDB_PROJECT"], **tracker_init_kwargs(args.run_name).get("wandb", {}))
    return tracker


def check_trackers_installed(report_to: Any) -> None:
    """A tracker `report_to` names that is not installed is an error, as in the HF Trainer (accelerate would only
    warn and train without it)."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    missing = []
    for name in names:
        available = getattr(accelerate_imports, f"is_{name}_available", None)
        if name not in ("all", "none") and available is not None and not available():
            missing.append(name)
    if missing:
        raise ValueError(
            f"GRPOConfig.report_to names {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
            f"installed: `pip install {' '.join(missing)}`, or leave {'it' if len(missing) == 1 else 'them'} out of "
            "report_to."
        )


def start_trackers(accelerator: Any, args: ResolvedConfig) -> None:
    """Start the trackers of `report_to` (the accelerator's `log_with`) for the run `args.run_name` in the project
    `args.project`, with the config as the run's hyperparameters."""
    accelerator.log_with = [_own_tracker(t, args, accelerator.logging_dir) for t in accelerator.log_with]
    unnamed = [str(t) for t in accelerator.log_with if str(t) in UNNAMED_RUNS]
    if args.run_name is not None and unnamed:
        warnings.warn(
            f"run_name={args.run_name!r} is not passed to {', '.join(unnamed)} (accelerate gives them the project "
            "only); name the run with that tracker's own setting (e.g. an environment variable).",
            stacklevel=5,  # the GRPOTrainer(...) call (through assemble)
        )
    plain = (int, float, str, bool)
    config = {k: v if isinstance(v, plain) or v is None else str(v) for k, v in args.to_dict().items()}
    accelerator.init_trackers(args.project, config=config, init_kwargs=tracker_init_kwargs(args.run_name))


def generation_metrics(
    generated: GenerationBatch,
    adv: Advantages,
    reward_names: list[str],
    dynamic_sampling: bool = False,
    tools: bool = False,
) -> dict[str, float]:
    """Lengths (model tokens only: tool results are not counted) and rewards of one generation batch (global: every
    process's completions), this process's generation, scoring and gathering time, with dynamic_sampling the groups it
    dropped and the rounds it took, and with tools TRL 1.16's tools/call_frequency (calls per completion) and
    tools/failure_frequency (failed calls per call)."""
    scored = generated.batch
    lengths = torch.tensor([sum(m) for m in scored.rollout.loss_mask], dtype=torch.float32)
    truncated = torch.tensor(scored.rollout.truncated, dtype=torch.bool)
    terminated = lengths[~truncated]
    m = {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": terminated.mean().item() if len(terminated) else 0.0,
        "completions/min_terminated_length": terminated.min().item() if len(terminated) else 0.0,
        "completions/max_terminated_length": terminated.max().item() if len(terminated) else 0.0,
        "reward": torch.nanmean(adv.rewards).item(),
        "reward_std": nanstd(adv.rewards).item(),
        "frac_reward_zero_std": adv.frac_zero_std,
        # this process's own generation speed
        "timing/generation_tokens_per_s": generated.tokens / max(generated.generation_s, 1e-9),
        "timing/generation_s": generated.generation_s,
        "timing/scoring_s": generated.scoring_s,
        "timing/gather_s": generated.gather_s,  # putting every process's rows together (0 on one process)
    }
    m.update(reward_and_tool_stats(scored, reward_names, tools))
    if dynamic_sampling:
        m["dynamic_sampling/groups_dropped"] = generated.groups_dropped
        m["dynamic_sampling/rounds"] = generated.rounds
    return m


def reward_and_tool_stats(scored: Any, reward_names: list[str], tools: bool) -> dict[str, float]:
    """Each reward function's mean and std over the scored completions and, with tools, TRL 1.16's
    tools/call_frequency (calls per completion) and tools/failure_frequency (failed calls per call); training and
    evaluation (with its eval_ prefix) log the same."""
    m = {}
    for k, name in enumerate(reward_names):
        m[f"rewards/{name}/mean"] = torch.nanmean(scored.rewards[:, k]).item()
        m[f"rewards/{name}/std"] = nanstd(scored.rewards[:, k]).item()
    if tools:
        calls, failures = sum(scored.rollout.tool_calls), sum(scored.rollout.tool_failures)
        m["tools/call_frequency"] = calls / max(len(scored), 1)
        m["tools/failure_frequency"] = failures / calls if calls else 0.0
    return m


def trl_logs(scored: Any, advantages: Any, reward_names: list[str], log_images: bool = True) -> dict[str, Any]:
    """The latest generation batch in the layout of TRL's `trainer._logs`, which TRL callbacks read: "prompt" (as
    the dataset gives it), "completion" (as reward functions get it), "rewards" and "extra" (name -> values), and
    "advantages" and "images" (each row's images; empty without image prompts and with log_multimodal=False). NaN
    for a None reward, as TRL."""
    if scored is None:
        return {"images": [], "prompt": [], "completion": [], "rewards": {}, "advantages": [], "extra": {}}
    rollout = scored.rollout
    vision = rollout.vision or []
    return {
        "images": [list(p.images or ()) if p is not None else [] for p in vision] if log_images and any(vision) else [],
        "prompt": list(scored.prompts),
        "completion": list(rollout.completions),
        "rewards": {name: scored.rewards[:, i].tolist() for i, name in enumerate(reward_names)},
        "advantages": advantages.tolist(),
        "extra": {k: list(v) for k, v in scored.extra.items()},
    }


class CompletionLog:
    """The completions of the latest generation batch (prompt, completion, one column per reward function, the
    columns reward functions add with `log_extra`, advantage), shown and saved at each logging step. With
    `log_unique_prompts` the table shows each prompt once, on its first row (as TRL's table does); the parquet
    file keeps every row."""

    def __init__(
        self,
        output_dir: str,
        reward_names: list[str],
        rows: int,
        seed: int,
        num_to_print: int | None = None,
        unique_prompts: bool = False,
        log_images: bool = True,
    ) -> None:
        """`rows`: the generation batch's (the latest batch is kept); `seed`: the sample printed; `num_to_print`,
        `unique_prompts`, `log_images`: num_completions_to_print, log_unique_prompts, log_multimodal."""
        self.output_dir = output_dir
        self.num_to_print = num_to_print
        self.unique_prompts = unique_prompts
        self.reward_names = reward_names
        self.rows: deque[dict[str, Any]] = deque(maxlen=rows)
        self.rng = random.Random(seed)
        self.log_images = log_images  # name each row's images in an "image" column

    @classmethod
    def of(cls, config: ResolvedConfig, reward_names: list[str]) -> CompletionLog:
        return cls(
            config.output_dir,
            reward_names,
            config.generation_batch_size,
            config.seed,
            config.num_completions_to_print,
            config.log_unique_prompts,
            config.log_multimodal,
        )

    def record(self, scored: Any, advantages: Any, tokenizer: Any) -> None:
        rollout = scored.rollout
        prompts = tokenizer.batch_decode(rollout.prompt_ids, skip_special_tokens=False)
        for i, (prompt, completion) in enumerate(zip(prompts, rollout.texts)):
            values = scored.rewards[i].tolist()
            rewards = {name: None if math.isnan(v) else v for name, v in zip(self.reward_names, values)}
            extra = {k: v[i] for k, v in scored.extra.items()}
            row = {"prompt": prompt, "completion": completion, **rewards, **extra, "advantage": float(advantages[i])}
            image_prompt = rollout.vision[i] if rollout.vision else None
            if image_prompt is not None:  # the template's text (one placeholder per image) and the images' names
                row["prompt"] = image_prompt.text or prompt
                if self.log_images:
                    row["image"] = ", ".join(image_name(image) for image in image_prompt.images or ())
            self.rows.append(row)

    def flush(self, step: int, console: Console) -> str | None:
        """Print a table of (a random sample of) the rows and write them to parquet; returns the file written."""
        if not self.rows:
            return None
        import pandas as pd

        rows = [{"step": step, **row} for row in self.rows]
        path = os.path.join(self.output_dir, "completions", f"completions_{step:05d}.parquet")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pd.DataFrame(rows).to_parquet(path, index=False)
        if self.num_to_print == 0:  # saved, not shown
            return path
        candidates = _first_of_each_prompt(rows) if self.unique_prompts else rows
        shown = (
            candidates
            if self.num_to_print is None or self.num_to_print >= len(candidates)
            else self.rng.sample(candidates, self.num_to_print)
        )
        table = Table(title=f"Completions at step {step}", show_lines=True)
        images = ["image"] if any("image" in row for row in shown) else []
        columns = ["prompt", *images, "completion", *self.reward_names, "advantage"]
        for name in columns:
            table.add_column(name, overflow="fold", ratio=3 if name in ("prompt", "completion") else 1)
        for row in shown:
            table.add_row(*[_cell(row.get(name)) for name in columns])
        console.print(table)
        return path


def _first_of_each_prompt(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first row of each prompt text: a group's rows share it, so one row per group."""
    seen: set[str] = set()
    first = []
    for row in rows:
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            first.append(row)
    return first


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)[-600:]
