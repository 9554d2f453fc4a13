"""Datasets beyond an in-memory `Dataset`: a streaming `IterableDataset` (with max_steps, resuming exactly), and local
json / jsonl / parquet / csv files and save_to_disk directories loaded by path."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset, IterableDataset

from grpo import GRPOTrainer
from grpo.data.datasets import StreamRows
from support.rewards import length_reward
from support.runs import cfg, chat_dataset, weights


def rows(n=12):
    return [{"prompt": [{"role": "user", "content": f"Solve {i}+1"}], "solution": str(i + 1)} for i in range(n)]


def stream(n=12):
    data = rows(n)
    return IterableDataset.from_generator(lambda: iter(data))


def test_a_stream_trains_in_order_and_resumes_exactly(tiny_model_dir, tmp_path):
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2, learning_rate=5e-2)
    seen = []

    def reward(completions, solution, **kw):
        seen.append(solution)
        return length_reward(completions)

    straight = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=reward, train_dataset=stream(), args=cfg(tmp_path / "a", **kw)
    )
    straight.train()
    # 2 prompts per step, read in order; the 12-row stream runs out after 6 steps' worth, so 4 steps stay in pass 1
    assert [s[0] for s in seen] == ["1", "3", "5", "7"] and [s[-1] for s in seen] == ["2", "4", "6", "8"]
    resumed = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, train_dataset=stream(), args=cfg(tmp_path / "b", **kw)
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-2"))
    final = weights(straight)
    assert all(torch.equal(p, final[n]) for n, p in weights(resumed).items())


def test_a_stream_needs_max_steps_and_rows(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="streaming dataset \\(no length\\): set max_steps"):
        GRPOTrainer(
            model=tiny_model_dir, reward_funcs=length_reward, train_dataset=stream(), args=cfg(tmp_path, max_steps=-1)
        )
    empty = IterableDataset.from_generator(lambda: iter([]))
    with pytest.raises(ValueError, match="empty stream"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=empty, args=cfg(tmp_path))
    no_prompt = IterableDataset.from_generator(lambda: iter([{"q": "x"}]))
    with pytest.raises(ValueError, match="rows have no 'prompt'"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=no_prompt, args=cfg(tmp_path))


def test_stream_rows_wrap_around_and_reread_from_the_start():
    reads = []

    def generate():
        reads.append(1)
        yield from ({"i": i} for i in range(5))

    rows_ = StreamRows(IterableDataset.from_generator(generate), window=3)
    assert [rows_[i]["i"] for i in range(12)] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    assert rows_[2]["i"] == 2  # behind the window: the stream is read again from its start
    with pytest.raises(TypeError, match="no length"):
        len(rows_)


@pytest.mark.parametrize("kind", ["json", "jsonl", "parquet", "csv", "disk"])
def test_local_files_load_by_path(tiny_model_dir, tmp_path, kind):
    data = [{"prompt": f"Solve {i}+1", "solution": str(i + 1)} for i in range(8)]
    path = tmp_path / f"train.{kind}"
    if kind == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in data))
    elif kind == "json":
        path.write_text(json.dumps(data))
    elif kind == "disk":
        Dataset.from_list(data).save_to_disk(str(path))
    else:
        getattr(Dataset.from_list(data), f"to_{kind}")(str(path))
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=str(path),
        eval_dataset=str(path),
        args=cfg(tmp_path),
    )
    assert len(trainer.train_dataset) == 8 and str(trainer.train_dataset[3]["solution"]) == "4"  # csv: a number
    trainer.train()
    assert "eval_reward" in trainer.evaluate()
    with pytest.raises(ValueError, match="does not exist"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=str(tmp_path / "nope.jsonl"))


def test_an_eval_stream_is_read_once(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        eval_dataset=stream(4),
        args=cfg(tmp_path),
    )
    assert "eval_pass@4" in trainer.evaluate()
