"""`grpo train`: a YAML recipe and flags (flags win), TRL's script and model arguments, reward functions by name or
dotted path, a local jsonl dataset; end to end in a subprocess, under torchrun with 2 processes, and its errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from grpo import train_cli
from support.launch import torchrun

REWARDS = """
def length_reward(completions, **kwargs):
    return [len(c[0]["content"]) / 8.0 for c in completions]
"""


def recipe(tmp_path, model_dir, **more):
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": f"Solve {i}+1"}]}) for i in range(8)))
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    values = dict(
        model_name_or_path=model_dir,
        dataset_name=str(data),
        reward_funcs=["my_rewards.length_reward", "think_format_reward"],
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        max_steps=5,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        bf16=False,
    )
    values.update(more)
    path = tmp_path / "recipe.yaml"
    path.write_text("\n".join(f"{k}: {json.dumps(v)}" for k, v in values.items()))
    return path


def run(tmp_path, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run(
        [sys.executable, "-m", "grpo", "train", *map(str, args)], cwd=tmp_path, capture_output=True, text=True, env=env
    )


def test_grpo_train_end_to_end(tiny_model_dir, tmp_path):
    done = run(
        tmp_path,
        "--config",
        recipe(tmp_path, tiny_model_dir),
        "--max_steps",
        "2",
        "--use_peft",
        "true",
        "--lora_target_modules",
        "q_proj",
        "v_proj",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Model saved to" in done.stdout
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]  # the flag won over the file's max_steps: 5
    assert "rewards/length_reward/mean" in rows[0] and "rewards/think_format_reward/mean" in rows[0]
    assert os.path.exists(tmp_path / "out" / "adapter_config.json")  # use_peft: the adapter is saved


def test_grpo_train_under_torchrun(tiny_model_dir, tmp_path):
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the dotted reward path resolves from the working directory
    try:
        torchrun(
            2,
            "-m",
            "grpo",
            "train",
            "--config",
            recipe(tmp_path, tiny_model_dir, per_device_train_batch_size=4),
            "--max_steps",
            "1",
            fresh=True,
        )
    finally:
        os.chdir(cwd)
    assert os.path.exists(tmp_path / "out" / "model.safetensors")


def test_arguments_parse_into_trls_groups(tiny_model_dir, tmp_path):
    script, args, model = train_cli.parse(
        ["--config", str(recipe(tmp_path, tiny_model_dir)), "--learning_rate", "3e-5", "--dtype", "bfloat16"]
    )
    assert script.dataset_train_split == "train" and script.reward_funcs[1] == "think_format_reward"
    assert args.learning_rate == 3e-5 and args.max_steps == 5 and model.dtype == "bfloat16"
    assert train_cli.model_init_kwargs(model, args) == {
        "revision": "main",
        "attn_implementation": None,
        "dtype": "bfloat16",
    }


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--learnig_rate", "1e-5"], "unknown argument '--learnig_rate'; did you mean 'learning_rate'"),
        (["--learning_rat", "1e-5"], "unknown argument '--learning_rat'; did you mean 'learning_rate'"),  # no prefixes
        (
            ["--reward_funcs", "acuracy_reward"],
            "unknown reward function 'acuracy_reward'; did you mean 'accuracy_reward'",
        ),
    ],
)
def test_mistakes_name_the_nearest_valid_one(tiny_model_dir, tmp_path, extra, message):
    with pytest.raises(SystemExit, match=message):
        train_cli.main(["--config", str(recipe(tmp_path, tiny_model_dir)), *extra])


def test_an_unknown_key_in_the_file(tiny_model_dir, tmp_path):
    path = recipe(tmp_path, tiny_model_dir)
    path.write_text(path.read_text() + "\nnum_generation: 4")
    with pytest.raises(SystemExit, match="unknown field 'num_generation'; did you mean 'num_generations'"):
        train_cli.parse(["--config", str(path)])
