"""Errors a user can cause: each gets one clear message naming the cause and the fix, before any saved
checkpoint is touched."""

from __future__ import annotations

import hashlib
import os
import sys

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.models.modeling import ModelLoadError
from grpo.rewards.calling import RewardFunctionError
from grpo.trainer import TrainingError
from support.rewards import length_reward
from support.runs import cfg, chat_dataset


def test_unknown_config_field_names_the_nearest():
    with pytest.raises(TypeError, match="num_generation'.*did you mean 'num_generations'"):
        GRPOConfig(num_generation=4)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(per_device_train_batch_size=6, num_generations=4), r"not divisible by num_generations \(4\)"),
        (dict(num_generations=1, per_device_train_batch_size=8), r"num_generations is 1; .*at least 2"),
        (dict(loss_type="ppo"), r"loss_type is 'ppo'; choose one of grpo, bnpo, dr_grpo, dapo"),
        (dict(scale_rewards="median"), r"scale_rewards is 'median'"),
        (dict(temperature=0.0), r"temperature is 0.0"),
        (dict(generation_batch_size=16, steps_per_generation=2), r"cannot both be set"),
        (dict(generation_batch_size=12, per_device_train_batch_size=8), r"must be a multiple of"),
        (dict(importance_sampling_level="tokens"), r"importance_sampling_level is 'tokens'"),
    ],
)
def test_invalid_config_values(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        GRPOConfig(output_dir="x", **kwargs)


def test_config_parses_with_hf_argument_parser():
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(
        [
            "--output_dir",
            "o",
            "--scale_rewards",
            "false",
            "--reward_weights",
            "1",
            "0.5",
            "--generation_kwargs",
            '{"top_k": 5}',
            "--loss_type",
            "grpo",
            "--beta",
            "0.001",
        ]
    )
    assert args.scale_rewards == "none" and args.reward_weights == [1.0, 0.5]
    assert args.generation_kwargs == {"top_k": 5} and args.beta == 0.001


def test_reference_defaults():
    a = GRPOConfig(output_dir="x")
    assert (a.num_generations, a.max_completion_length, a.temperature, a.top_p, a.beta, a.loss_type) == (
        8,
        256,
        1.0,
        1.0,
        0.0,
        "dapo",
    )
    assert (a.scale_rewards, a.epsilon, a.num_iterations, a.mask_truncated_completions, a.reward_weights) == (
        "group",
        0.2,
        1,
        False,
        None,
    )
    assert (a.learning_rate, a.logging_steps, a.gradient_checkpointing, a.epsilon_high) == (1e-6, 10, True, 0.2)
    assert a.steps_per_generation == a.gradient_accumulation_steps == 1 and a.generation_batch_size == 8


def test_later_features_say_not_available(tiny_model_dir, tmp_path):
    with pytest.raises(TypeError, match="peft_config is a dict; pass a peft.PeftConfig such as LoraConfig"):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path),
            peft_config={"r": 8},
        )
    with pytest.raises(ValueError, match="cannot describe the tool 'print'.*type hint on every argument"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), tools=[print])
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size must be >= 1"):
        cfg(tmp_path, use_vllm=True, vllm_tensor_parallel_size=0)
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=2 splits one vLLM engine.*this run has 1"):
        GRPOTrainer(  # refused before vLLM is imported or started
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path, use_vllm=True, vllm_tensor_parallel_size=2),
        )
    images = Dataset.from_list([{"prompt": "a", "image": "x.png"}] * 8)
    with pytest.raises(ValueError, match="'image' column, but the model is text-only.*remove the column"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=images, args=cfg(tmp_path))


def test_use_vllm_without_vllm_says_how_to_install_it(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(ImportError, match=r"use_vllm=True needs vLLM.*pip install 'grpo\[vllm\]'.*use_vllm=False"):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path, use_vllm=True),
        )


@pytest.mark.parametrize(
    "dataset, pattern",
    [
        (Dataset.from_list([{"question": "a"}] * 8), r"no 'prompt' column \(columns: \['question'\]\).*rename_column"),
        (Dataset.from_dict({"prompt": []}), "train_dataset is empty"),
        (Dataset.from_list([{"prompt": "a"}]), r"has 1 prompts but one generation needs 2 distinct prompts"),
    ],
)
def test_bad_datasets(tiny_model_dir, tmp_path, dataset, pattern):
    with pytest.raises(ValueError, match=pattern):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=dataset, args=cfg(tmp_path))


def test_unreachable_model_id_fails_in_one_clear_line(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError) as err:
        GRPOTrainer(
            model="no-such-org/no-such-model",
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path),
        )
    message = str(err.value)
    assert "no-such-org/no-such-model" in message and "local model directory" in message
    assert "\n" not in message


def test_reward_function_arity_and_weights_checked_up_front(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="reward_weights has 2 entries but there are 1 reward functions"):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path, reward_weights=[1.0, 2.0]),
        )
    # a reward model that cannot be loaded fails at construction, naming it
    with pytest.raises(ModelLoadError, match="reward model 'no-such-org/reward-model'"):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=[length_reward, "no-such-org/reward-model"],
            train_dataset=chat_dataset(),
            args=cfg(tmp_path),
        )
    with pytest.raises(
        ValueError, match=r"number of reward processing classes \(1\) must match the number of reward functions \(2\)"
    ):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=[length_reward, length_reward],
            train_dataset=chat_dataset(),
            args=cfg(tmp_path),
            reward_processing_classes=[None],
        )


def _tree_hash(path):
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            with open(os.path.join(root, name), "rb") as f:
                h.update(name.encode() + f.read())
    return h.hexdigest()


@pytest.mark.parametrize(
    "bad, pattern",
    [
        (lambda n: [1.0] * (n - 1), r"'flaky' returned 7 values for 8 completions"),
        (lambda n: ["good"] * n, r"'flaky' returned 'good' \(str\) for sample 0; rewards must be numbers"),
        (lambda n: [0.0] * (n - 1) + [float("nan")], r"'flaky' returned nan for sample 7; .*Return None"),
        (lambda n: [float("inf")] + [0.0] * (n - 1), r"'flaky' returned inf for sample 0"),
        (lambda n: 1 / 0, r"'flaky' raised ZeroDivisionError"),
    ],
)
def test_bad_reward_stops_training_and_keeps_checkpoint(tiny_model_dir, tmp_path, bad, pattern):
    seen = {}
    out = str(tmp_path / "out")

    def flaky(completions, trainer_state, **kwargs):
        if trainer_state.global_step == 0:
            return length_reward(completions)
        seen["hash"] = _tree_hash(os.path.join(out, "checkpoint-1"))
        return bad(len(completions))

    args = cfg(tmp_path, max_steps=3, save_strategy="steps", save_steps=1)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=flaky, train_dataset=chat_dataset(), args=args)
    with pytest.raises(RewardFunctionError, match=pattern):
        trainer.train()
    assert trainer.state.global_step == 1
    assert _tree_hash(os.path.join(out, "checkpoint-1")) == seen["hash"]
    assert not os.path.exists(os.path.join(out, "checkpoint-2"))


def test_nonfinite_loss_stops_before_the_update(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=cfg(tmp_path, max_steps=3)
    )
    poison = {"on": False}

    def hook(module, inputs, output):
        return output * float("nan") if poison["on"] and module.training else output

    # the last hidden states (the training pass projects them itself, past the model's own head)
    trainer.unwrapped_model.model.norm.register_forward_hook(hook)
    original = trainer._step

    def step():
        poison["on"] = trainer.state.global_step == 1
        if poison["on"]:
            step.before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        return original()

    trainer._step = step
    with pytest.raises(TrainingError, match=r"Step 2: the loss is nan; training stopped before the optimizer"):
        trainer.train()
    assert all(torch.equal(p, step.before[n]) for n, p in trainer.model.named_parameters())


def emulate_fp16_loss_scaling(monkeypatch):
    """Trainers made after this get accelerate's CUDA fp16 setup on the CPU: a GradScaler (torch's CPU one, starting
    at 2^24, which overflows float16 gradients here) and fp16 autocast."""
    import grpo.assembly

    make = grpo.assembly.make_accelerator

    def fp16_with_loss_scaling(args):
        accelerator = make(args)
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
        accelerator.native_amp, accelerator.state._mixed_precision = True, "fp16"
        return accelerator

    monkeypatch.setattr(grpo.assembly, "make_accelerator", fp16_with_loss_scaling)


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_fp16_loss_scale_overflow_skips_the_step_and_training_goes_on(
    tiny_model_dir, tmp_path, monkeypatch, max_grad_norm
):
    """fp16 with loss scaling, as accelerate sets it up on CUDA (a GradScaler, fp16 autocast), emulated on the CPU
    with torch's CPU GradScaler and a start scale (2^24) that overflows float16 gradients: a step whose scaled
    gradients overflow is skipped by the scaler, which lowers the scale. No error: the skipped step logs no
    gradient norm, neither the weights nor the learning-rate schedule move, and the steps after train. The norm
    logged is the true gradients' (unscaled), with clipping or without."""
    from transformers import AutoModelForCausalLM

    emulate_fp16_loss_scaling(monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, max_steps=8, max_grad_norm=max_grad_norm),
        optimizers=(sgd, None),
    )
    original, weights = trainer._step, []

    def step():
        loss = original()
        weights.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        return loss

    trainer._step = step
    trainer.train()
    rows = trainer.state.log_history
    skipped = [row["grad_norm"] is None for row in rows]
    assert skipped[0] and not all(skipped), skipped
    assert all(row["grad_norm"] < 100 for row in rows if row["grad_norm"] is not None)  # not scaled by 2^21
    schedule = [1e-2 * (8 - k) / 8 for k in range(1, 9)]
    taken, previous = 0, initial
    for row, was_skipped, after in zip(rows, skipped, weights):
        moved = any(not torch.equal(after[n], previous[n]) for n in after)
        assert not moved if was_skipped else moved is (row["grad_norm"] > 0)
        taken += not was_skipped
        assert row["learning_rate"] == pytest.approx(schedule[taken - 1] if taken else 1e-2)
        previous = after
    assert any(not torch.equal(weights[-1][n], initial[n]) for n in initial)


def test_fp16_loss_scale_is_checkpointed(tiny_model_dir, tmp_path, monkeypatch):
    emulate_fp16_loss_scaling(monkeypatch)
    args = cfg(tmp_path, max_steps=3, save_strategy="steps", save_steps=3)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    trainer.train()
    scale = trainer.accelerator.scaler.get_scale()
    assert scale < 2.0**24  # lowered by the overflows
    resumed = GRPOTrainer(model=tiny_model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args)
    resumed.train(resume_from_checkpoint=True)  # nothing left to train: only the restore
    assert resumed.accelerator.scaler.get_scale() == scale


def test_quantization_config_goes_to_loading_and_needs_a_model_id(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from grpo.config import resolve_args

    marker = object()
    args = resolve_args(cfg(tmp_path), "tiny", tiny_model_dir, marker)
    assert args.model_init_kwargs["quantization_config"] is marker
    with pytest.raises(ValueError, match="quantization_config applies when the trainer loads the model"):
        GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path),
            quantization_config=marker,
        )
