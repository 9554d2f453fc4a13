"""The Hub and the model card.

The model card (README.md) is written locally beside every saved model, in the output directory and in every
checkpoint, whether or not anything is pushed: the base model, the dataset, the reward functions and their weights,
the settings that differ from TRL 1.16's defaults, the last logged metrics and the versions it was trained with,
with the Hub's metadata header (`huggingface_hub.ModelCardData`).

Pushing follows the HF Trainer's fields, through `huggingface_hub`: with `push_to_hub`, the repository
(`hub_model_id`, default the output directory's name, in the token's namespace; private with `hub_private_repo`) is
created when training starts; `hub_strategy` "every_save" pushes the output directory's model files at every
checkpoint, "checkpoint" also the newest checkpoint as `last-checkpoint/` (resumable from the Hub),
"all_checkpoints" every checkpoint under its own name, "end" nothing until `trainer.push_to_hub()`. Pushes during
training run in the background; a new one is skipped while one is in flight (unless `hub_always_push`), and a
failed one is a warning (the checkpoint is on disk). `push_to_hub()` waits for them, saves the model and its card
and pushes them (an error there is raised). Only the main process talks to the Hub; `hub_token` and
`hub_revision` go with every call.

What a push sends from the output directory: the model (weights, config, adapter, custom code), its tokenizer or
processor and its card (README.md), nothing else (`PUSHED`). The run's own files there (report.html, run_info.json,
metrics.jsonl, the completions parquet files with the dataset's prompts) go only with `hub_upload_run_files=True`
(the HF Trainer's behaviour: the whole directory); hub_strategy "checkpoint" and "all_checkpoints" send the whole
checkpoint directory, which is what resuming from the Hub needs. The card holds no secret (`grpo.base.secrets`).
"""

from __future__ import annotations

import fnmatch
import glob
import json
import logging
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import huggingface_hub
import torch

from grpo.base import secrets
from grpo.config import ResolvedConfig
from grpo.observe.report import record

logger = logging.getLogger("grpo")
# a checkpoint's files that make the model, copied beside the output directory's tokenizer and card for a push
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
)
# what a push sends from the output directory's top level, unless hub_upload_run_files
PUSHED = (
    "README.md",
    *MODEL_FILES,
    *("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab*", "merges.txt", "*.model", "*.tiktoken"),
    *("chat_template.*", "*preprocessor_config.json", "processor_config.json"),
    *("configuration_*.py", "modeling_*.py", "tokenization_*.py", "processing_*.py", "image_processing_*.py"),
)
SKIPPED = ["_*", ".*", "checkpoint-*", ".tmp-checkpoint-*"]


@dataclass(frozen=True)
class HubSettings:
    """What the Hub reads of the config: its hub_* fields, push_to_hub, the output directory it pushes from, and the
    completions upload (log_completions, log_completions_hub_repo)."""

    output_dir: str
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_strategy: str = "every_save"
    hub_token: str | None = field(default=None, repr=False)
    hub_private_repo: bool | None = None
    hub_always_push: bool = False
    hub_revision: str | None = None
    hub_upload_run_files: bool = False
    log_completions: bool = False
    log_completions_hub_repo: str | None = None

    @classmethod
    def of(cls, config: ResolvedConfig) -> HubSettings:
        return cls(
            output_dir=config.output_dir,
            push_to_hub=config.push_to_hub,
            hub_model_id=config.hub_model_id,
            hub_strategy=config.hub_strategy,
            hub_token=config.hub_token,
            hub_private_repo=config.hub_private_repo,
            hub_always_push=config.hub_always_push,
            hub_revision=config.hub_revision,
            hub_upload_run_files=config.hub_upload_run_files,
            log_completions=config.log_completions,
            log_completions_hub_repo=config.log_completions_hub_repo,
        )


class Hub:
    def __init__(self, settings: HubSettings, is_main_process: bool) -> None:
        self.settings = settings
        self.active = bool(settings.push_to_hub) and is_main_process
        self.repo_id: str | None = None
        self.jobs: list = []

    def api(self) -> huggingface_hub.HfApi:
        return huggingface_hub.HfApi(token=self.settings.hub_token)

    def create_repo(self) -> None:
        if not self.active or self.repo_id is not None:
            return
        name = self.settings.hub_model_id or Path(self.settings.output_dir).absolute().name
        self.repo_id = self.api().create_repo(name, private=self.settings.hub_private_repo, exist_ok=True).repo_id

    def start_completions_upload(self, is_main_process: bool) -> None:
        """log_completions_hub_repo (TRL 1.16): the completions parquet files go to that dataset repository, committed
        every 2 minutes in the background by huggingface_hub's CommitScheduler (and once more at the end)."""
        a = self.settings
        self.completions_scheduler = None
        if not a.log_completions_hub_repo or not is_main_process:
            return
        if not a.log_completions:
            logger.warning("log_completions_hub_repo is set but log_completions is False: no completions are logged.")
            return
        api = self.api()
        api.create_repo(a.log_completions_hub_repo, private=a.hub_private_repo, repo_type="dataset", exist_ok=True)
        card = huggingface_hub.DatasetCard(
            "---\n"
            + huggingface_hub.DatasetCardData(
                pretty_name="grpo completion logs", tags=["grpo", "completions"]
            ).to_yaml()
            + "\n---\n\n# Completions logged by grpo\n\nOne parquet file per logging step: prompt, completion, each "
            f"reward function, advantage{f' (model: {a.hub_model_id})' if a.hub_model_id else ''}.\n"
        )
        card.push_to_hub(a.log_completions_hub_repo, repo_type="dataset", token=a.hub_token)
        folder = os.path.join(a.output_dir, "completions")
        os.makedirs(folder, exist_ok=True)
        self.completions_scheduler = huggingface_hub.CommitScheduler(
            repo_id=a.log_completions_hub_repo,
            repo_type="dataset",
            folder_path=folder,
            every=2,
            allow_patterns=["*.parquet"],
            token=a.hub_token,
        )

    def finish_completions_upload(self) -> None:
        """The last completions, committed at the end of train()."""
        scheduler = getattr(self, "completions_scheduler", None)
        if scheduler is not None:
            try:
                scheduler.trigger().result()
            except Exception as err:
                logger.warning(
                    "Uploading the last completions to %s failed: %s", self.settings.log_completions_hub_repo, err
                )

    def after_checkpoint(
        self, checkpoint_dir: str, step: int, processing_class: Any, write_card: Callable[[str], str]
    ) -> None:
        """hub_strategy's background pushes after checkpoint-<step> was written at `checkpoint_dir` (the output
        directory gets its model files, `processing_class` and the card `write_card` writes)."""
        a = self.settings
        if not self.active or a.hub_strategy == "end":
            return
        if not a.hub_always_push and any(not job.done() for job in self.jobs):
            return
        self.create_repo()
        for name in _matching(checkpoint_dir, MODEL_FILES):  # the model as of this checkpoint, beside the card
            shutil.copy(os.path.join(checkpoint_dir, name), os.path.join(a.output_dir, name))
        processing_class.save_pretrained(a.output_dir)
        write_card(a.output_dir)
        message = f"Training in progress, step {step}"
        try:
            self.jobs = [self._upload(a.output_dir, message, future=True)]
            if a.hub_strategy in ("checkpoint", "all_checkpoints"):
                where = "last-checkpoint" if a.hub_strategy == "checkpoint" else os.path.basename(checkpoint_dir)
                self.jobs.append(
                    self._upload(checkpoint_dir, message + ", checkpoint", future=True, path_in_repo=where)
                )
        except Exception as err:  # the checkpoint is on disk: a push that cannot start does not stop training
            logger.warning("Pushing checkpoint %s to the Hub failed (%s); training goes on.", checkpoint_dir, err)

    def push(
        self,
        commit_message: str,
        blocking: bool,
        save_model: Callable[[], None],
        write_card: Callable[..., str],
        is_main_process: bool,
        **card: Any,
    ) -> Any:
        """trainer.push_to_hub: the final model (`save_model`, every process) and its card (`write_card(directory,
        **card)`), after the background pushes."""
        if not self.active and is_main_process:
            self.active = True  # push_to_hub() called with push_to_hub=False: push anyway, as the HF Trainer
        save_model()
        if not is_main_process:
            return None
        self.create_repo()
        for job in self.jobs:
            try:
                job.result()
            except Exception as err:
                logger.warning("A background push to the Hub had failed: %s", err)
        self.jobs = []
        write_card(self.settings.output_dir, **card)
        return self._upload(self.settings.output_dir, commit_message, future=not blocking)

    def _upload(self, folder: str, message: str, future: bool, path_in_repo: str | None = None) -> Any:
        """`folder` to the repository: a checkpoint whole (path_in_repo), the output directory's model and card
        (PUSHED) unless hub_upload_run_files."""
        whole = path_in_repo is not None or self.settings.hub_upload_run_files
        assert self.repo_id is not None  # create_repo() ran
        # run_as_future is a bool here: huggingface_hub overloads upload_folder on its True and False literals
        return self.api().upload_folder(  # type: ignore[call-overload]
            repo_id=self.repo_id,
            folder_path=folder,
            path_in_repo=path_in_repo,
            commit_message=message,
            revision=self.settings.hub_revision,
            allow_patterns=None if whole else [glob.escape(name) for name in _matching(folder, PUSHED)],
            ignore_patterns=SKIPPED,
            run_as_future=future,
        )


def _matching(directory: str, patterns: tuple[str, ...]) -> list[str]:
    """The names of the files at `directory`'s top level that match one of `patterns`."""
    names = sorted(n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n)))
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


@dataclass(frozen=True)
class ModelCard:
    """What a run's model card (README.md) says besides its progress: the base model (its config's
    `_name_or_path`; None for a model built in code), the training dataset's name, the reward functions' names and
    weights, and the config (its output_dir and the settings that differ from TRL 1.16's defaults, read when the
    card is written)."""

    base_model: str | None
    dataset: str | None
    reward_names: list[str]
    reward_weights: torch.Tensor
    args: ResolvedConfig

    @classmethod
    def of(cls, model: Any, train_dataset: Any, rewards: Any, args: ResolvedConfig) -> ModelCard:
        """`model`: the policy, unwrapped; `rewards`: the `grpo.rewards.calling.RewardFunctions`."""
        config = getattr(model, "config", None)
        base = getattr(config, "_name_or_path", None) or None
        return cls(base, _dataset_name(train_dataset), list(rewards.names), rewards.weights, args)

    def write(self, state: Any, directory: str, dataset_name: str | None = None, **extra: Any) -> str:
        """README.md in `directory`, with the trainer state's step and last logged metrics; returns its path."""
        base, args = self.base_model, self.args
        dataset = dataset_name or self.dataset
        data = huggingface_hub.ModelCardData(
            base_model=base if base and not os.path.isabs(base) else None,
            datasets=[dataset] if dataset else None,
            library_name="transformers",
            tags=["grpo", "trl", "reinforcement-learning", *extra.pop("tags", [])],
        )
        weights = self.reward_weights.tolist()
        rewards = "\n".join(f"| `{name}` | {weight:g} |" for name, weight in zip(self.reward_names, weights))
        last: dict[str, Any] = next(
            (row for row in reversed(state.log_history) if "loss" in row or "eval_reward" in row), {}
        )
        metrics = "\n".join(f"| `{k}` | {_cell(v)} |" for k, v in last.items())
        versions = record.versions()
        body = f"""---
{data.to_yaml()}
---

# {Path(args.output_dir).name}

Trained with [grpo](https://pypi.org/project/grpo/) {versions.get("grpo", "unknown")}: GRPO (Group Relative Policy
Optimization, [DeepSeekMath, arXiv:2402.03300](https://arxiv.org/abs/2402.03300)),
{state.global_step} optimizer steps from `{base or "a model object"}`{f" on `{dataset}`" if dataset else ""}.

## Reward functions

| function | weight |
|---|---|
{rewards}

## Settings that differ from TRL 1.16's defaults

```json
{json.dumps(record.non_default(args.to_dict()), indent=1, default=str)}
```

## Last logged metrics

| metric | value |
|---|---|
{metrics or "| (none yet) | |"}

## Versions

{", ".join(f"{name} {version}" for name, version in versions.items())}
"""
        path = os.path.join(directory, "README.md")
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as f:
            f.write(secrets.redact_text(body))  # the settings come redacted; a token passed in a card field is too
        return path


def _dataset_name(dataset: Any) -> str | None:
    info = getattr(dataset, "info", None) or getattr(getattr(dataset, "dataset", None), "info", None)
    name = getattr(info, "dataset_name", None)
    return name if isinstance(name, str) and name not in ("json", "parquet", "csv", "generator") else None


def _cell(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.6g}"
    return str(value)
