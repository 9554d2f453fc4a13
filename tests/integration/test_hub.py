"""Hub upload (huggingface_hub's API replaced by a recorder: no network here) and the model card, which is written
locally in the output directory and every checkpoint."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from grpo import GRPOTrainer
from support.hub import FakeApi, FakeScheduler
from support.rewards import length_reward
from support.runs import cfg, chat_dataset


@pytest.fixture
def hub():
    FakeApi.calls, FakeApi.fail = [], False
    with mock.patch("huggingface_hub.HfApi", FakeApi):
        yield FakeApi


def train(model_dir, tmp_path, **kw):
    args = cfg(tmp_path, push_to_hub=True, hub_token="tok", max_steps=2, save_strategy="steps", save_steps=1, **kw)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    trainer.train()
    return trainer


def uploads(calls):
    return [c[2:5] for c in calls if c[0] == "upload"]


def test_every_save_pushes_the_model_and_push_to_hub_the_final_one(hub, tiny_model_dir, tmp_path):
    trainer = train(tiny_model_dir, tmp_path, hub_model_id="me/run", hub_private_repo=True)
    assert hub.calls[0] == ("create_repo", "me/run", True, "tok")
    assert uploads(hub.calls) == [
        ("out", None, "Training in progress, step 1"),
        ("out", None, "Training in progress, step 2"),
    ]
    trainer.push_to_hub()
    assert uploads(hub.calls)[-1] == ("out", None, "End of training")
    pushed = hub.calls[-1][-1]
    assert {"README.md", "config.json", "model.safetensors", "tokenizer_config.json"} <= set(pushed)


@pytest.mark.parametrize(
    "strategy, extra",
    [
        ("checkpoint", [("checkpoint-1", "last-checkpoint"), ("checkpoint-2", "last-checkpoint")]),
        ("all_checkpoints", [("checkpoint-1", "checkpoint-1"), ("checkpoint-2", "checkpoint-2")]),
        ("end", []),
    ],
)
def test_hub_strategies(hub, tiny_model_dir, tmp_path, strategy, extra):
    train(tiny_model_dir, tmp_path, hub_strategy=strategy)
    pushed = [(folder, where) for folder, where, _ in uploads(hub.calls)]
    models = [] if strategy == "end" else [("out", None)]
    assert pushed == [p for step in range(2) for p in (models + extra[step : step + 1])]
    assert hub.calls[0][1] == "out"  # hub_model_id defaults to the output directory's name


def test_a_failed_push_during_training_is_a_warning(hub, tiny_model_dir, tmp_path, caplog):
    hub.fail = True
    trainer = train(tiny_model_dir, tmp_path)
    assert trainer.state.global_step == 2 and "Pushing checkpoint" in caplog.text
    with pytest.raises(OSError, match="no network"):
        trainer.push_to_hub()


def test_the_model_card_is_written_locally_without_the_hub(tiny_model_dir, tmp_path):
    args = cfg(tmp_path, max_steps=2, save_strategy="steps", save_steps=2, learning_rate=3e-3)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    trainer.train()
    trainer.save_model()
    for directory in (tmp_path / "out", tmp_path / "out" / "checkpoint-2"):
        card = (directory / "README.md").read_text()
        assert card.startswith("---\n") and "library_name: transformers" in card and "- grpo" in card
        assert "| `length_reward` | 1 |" in card and '"learning_rate": 0.003' in card
        assert "2 optimizer steps" in card and "| `reward` |" in card and "transformers 5." in card


def test_completions_go_to_a_dataset_repository(hub, tiny_model_dir, tmp_path):
    FakeScheduler.made = []
    cards = []
    with (
        mock.patch("huggingface_hub.CommitScheduler", FakeScheduler),
        mock.patch("huggingface_hub.DatasetCard.push_to_hub", lambda card, repo, **kw: cards.append((repo, kw))),
    ):
        args = cfg(tmp_path, log_completions=True, log_completions_hub_repo="me/completions", hub_private_repo=True)
        trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
        trainer.train()
    assert ("create_repo", "me/completions", True, None, "dataset") in hub.calls
    assert cards == [("me/completions", {"repo_type": "dataset", "token": None})]
    (scheduler,) = FakeScheduler.made
    assert scheduler.kwargs["repo_id"] == "me/completions" and scheduler.kwargs["repo_type"] == "dataset"
    assert scheduler.kwargs["folder_path"] == str(tmp_path / "out" / "completions") and scheduler.triggered == 1
    assert os.listdir(tmp_path / "out" / "completions") == ["completions_00001.parquet"]


RUN_FILES = {"report.html", "run_info.json", "metrics.jsonl", "completions/completions_00002.parquet"}


def test_a_push_sends_the_model_and_its_card_only(hub, tiny_model_dir, tmp_path):
    """The run's report, run_info.json, metrics and completions (the dataset's prompts) stay local: the repository
    may be public (hub_private_repo is None by default)."""
    trainer = train(tiny_model_dir, tmp_path, log_completions=True)
    trainer.push_to_hub()
    assert RUN_FILES <= {p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*")}
    for pushed in [c[-1] for c in hub.calls if c[0] == "upload"]:  # every save's push and the final one
        assert set(pushed) == {
            "README.md",
            "chat_template.jinja",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        }


def test_hub_upload_run_files_sends_the_run_files_too(hub, tiny_model_dir, tmp_path):
    trainer = train(tiny_model_dir, tmp_path, log_completions=True, hub_upload_run_files=True)
    trainer.push_to_hub()
    pushed = set(hub.calls[-1][-1])
    assert RUN_FILES <= pushed and {"README.md", "model.safetensors"} <= pushed
    assert not any(name.startswith(("checkpoint-", ".")) for name in pushed)


def test_a_checkpoint_push_sends_the_whole_checkpoint(hub, tiny_model_dir, tmp_path):
    """hub_strategy="checkpoint" asks for a resumable checkpoint on the Hub: all its files go."""
    train(tiny_model_dir, tmp_path, hub_strategy="checkpoint")
    (folder, where, _, files) = [c[2:] for c in hub.calls if c[0] == "upload"][-1]
    assert (folder, where) == ("checkpoint-2", "last-checkpoint")
    assert {"trainer_state.json", "optimizer.pt", "scheduler.pt", "model.safetensors", "README.md"} <= set(files)
