"""Training with vLLM (colocate mode) on this CPU: every parameter moves, the sampling/* metrics say the engine
samples the policy, the importance-sampling weight enters the loss, resume continues where the checkpoint left
off, and several processes (DDP, FSDP, LoRA) each hold the policy's weights in their own engine."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from support.launch import job_script, torchrun
from support.runs import chat_dataset, generate
from support.vllm_runs import FP32_TOL, engine_logps, fixed_completion, make_trainer, policy_logps

JOB = job_script("vllm_job.py")


def test_training_with_vllm_moves_every_parameter_and_logs_the_sampling_metrics(vllm_model_dir, tmp_path):
    trainer = make_trainer(vllm_model_dir, tmp_path, max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.unwrapped_model.named_parameters()}
    trainer.train()
    for name, param in trainer.unwrapped_model.named_parameters():
        assert not torch.equal(param, before[name]), f"{name} did not change"
    for row in trainer.state.log_history:
        # float32 engine and policy: the same distribution up to kernel rounding
        assert row["sampling/sampling_logp_difference/max"] < FP32_TOL
        assert abs(row["sampling/importance_sampling_ratio/mean"] - 1) < 1e-2
        assert row["sampling/importance_sampling_ratio/clipped_fraction"] == 0.0
    assert trainer.parts.correction.apply
    # the engine holds the final weights once synced: the next generation would sample the trained policy
    trainer.engine.sync_weights(trainer.unwrapped_model)
    prompt, completion = fixed_completion(trainer)
    diff = engine_logps(trainer.engine, prompt, completion) - policy_logps(trainer, prompt, completion)
    assert diff.abs().max() < FP32_TOL


def test_the_importance_weight_scales_the_update_and_off_turns_it_off(vllm_model_dir, tmp_path):
    """The same vLLM rollout, its log-probs shifted down by 0.2 per token (a mismatched sampler), trained with and
    without the correction: token_truncate's weight exp(0.2) on every token scales the gradient by exactly that."""
    grads, fixed = {}, []
    for correction in (True, False):
        trainer = make_trainer(
            vllm_model_dir,
            tmp_path / str(correction),
            vllm_importance_sampling_correction=correction,
            vllm_importance_sampling_mode="token_truncate",
        )
        original = trainer.engine.generate

        def shifted(requests, original=original):
            if not fixed:  # one rollout for both runs
                rollout = original(requests)
                rollout.sampling_logps = [[lp - 0.2 for lp in row] for row in rollout.sampling_logps]
                fixed.append(rollout)
            return fixed[0]

        trainer.engine.generate = shifted
        trainer.train()
        row = trainer.state.log_history[-1]
        grads[correction] = row["grad_norm"]
        assert row["sampling/importance_sampling_ratio/mean"] == pytest.approx(math.exp(0.2), rel=1e-3)
    assert grads[True] / grads[False] == pytest.approx(math.exp(0.2), rel=2e-3)


def test_a_reused_batch_compares_vllm_with_the_old_policy(vllm_model_dir, tmp_path):
    """num_iterations=2: the batch is trained twice, so its old log-probs are computed at generation and the
    importance weight compares vLLM with them (not with the moving policy): still ~1 for a float32 engine."""
    trainer = make_trainer(vllm_model_dir, tmp_path, num_iterations=2, max_steps=2)
    assert trainer._needs_old_logps()
    trainer.train()
    for row in trainer.state.log_history:
        assert abs(row["sampling/importance_sampling_ratio/mean"] - 1) < 1e-2
        assert row["sampling/sampling_logp_difference/max"] < FP32_TOL


def test_resume_with_vllm_continues_from_the_checkpoint(vllm_model_dir, tmp_path):
    """vLLM's sampling is not bit-reproducible across runs the way the fast engine is, so the resumed run's
    completions differ; what holds: it continues at the checkpoint's step, data position and optimizer state,
    and its engine samples from the checkpoint's weights."""
    first = make_trainer(vllm_model_dir, tmp_path, max_steps=3, save_strategy="steps", save_steps=2)
    first.train()
    position = first.parts.loop.data_position
    resumed = make_trainer(vllm_model_dir, tmp_path, max_steps=3, save_strategy="steps", save_steps=2)
    checkpoint = os.path.join(str(tmp_path / "out"), "checkpoint-2")
    synced = []
    original = resumed.engine.sync_weights

    def recording_sync(model):
        synced.append({n: p.detach().clone() for n, p in model.named_parameters()})
        original(model)

    resumed.engine.sync_weights = recording_sync
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.state.global_step == 3 and resumed.parts.loop.data_position == position
    # the first sync after resume carried the checkpoint's weights (saved in model.safetensors)
    from safetensors.torch import load_file

    saved = load_file(os.path.join(checkpoint, "model.safetensors"))
    for name, tensor in synced[0].items():
        assert torch.equal(tensor, saved[name]), name
    step_rows = [r for r in resumed.state.log_history if "loss" in r]
    assert [r["step"] for r in step_rows][-1] == 3


# zero3 and ddp+lora (~25 s each) run with `make test-slow`: the suite's CI budget; LoRA's merged weights are
# checked in one process by test_vllm_engine.py, gathering in two by fsdp
@pytest.mark.parametrize(
    "mode",
    ["ddp", "fsdp", pytest.param("zero3", marks=pytest.mark.slow), pytest.param("ddp+lora", marks=pytest.mark.slow)],
)
def test_every_process_engine_holds_the_policys_weights(vllm_model_dir, tmp_path, mode):
    torchrun(2, JOB, tmp_path, vllm_model_dir, mode, timeout=420)
    rows = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(2)]
    assert [r["world"] for r in rows] == [2, 2]
    engines = [torch.tensor(r["engine"]) for r in rows]
    assert torch.allclose(engines[0], engines[1], atol=1e-6)  # the same weights in both engines
    for row in rows:
        diff = (torch.tensor(row["engine"]) - torch.tensor(row["policy"])).abs()
        assert diff.max() < FP32_TOL, (mode, diff.max())
        assert row["sampling"]["sampling/sampling_logp_difference/max"] < FP32_TOL


@pytest.mark.parametrize("mode", ["ddp+tp", pytest.param("fsdp+tp", marks=pytest.mark.slow)])
def test_a_tensor_parallel_engine_shared_by_two_processes_samples_each_ones_rows_from_the_policy(
    vllm_model_dir, tmp_path, mode
):
    """vllm_tensor_parallel_size=2: one engine split across the two processes (one shard each). Training moves
    on with the sampling log-probs equal to the policy's, although one process's random stream is moved before
    every step (unseeded, the shards would sample different tokens and mix them); after training, the processes
    ask for different numbers of rows and each gets its own, scored as the policy scores them."""
    torchrun(2, JOB, tmp_path, vllm_model_dir, mode, timeout=420)
    rows = [json.load(open(tmp_path / f"rank{i}.json")) for i in range(2)]
    for rank, row in enumerate(rows):
        assert (torch.tensor(row["engine"]) - torch.tensor(row["policy"])).abs().max() < FP32_TOL
        assert row["sampling"]["sampling/sampling_logp_difference/max"] < FP32_TOL
        assert len(row["rows"]) == 2 * (rank + 1)  # its own prompts, 2 samples each, in order
        assert [r["prompt"] for r in row["rows"]] == [p for p in row["asked"] for _ in range(2)]
        for sample in row["rows"]:
            diff = (torch.tensor(sample["sampling"]) - torch.tensor(sample["policy"])).abs()
            assert diff.max() < FP32_TOL, (rank, diff.max())


def test_the_engine_is_not_used_for_an_unknown_dataset_shape(vllm_model_dir, tmp_path):
    """A careless input still gets grpo's own error before any vLLM work (the dataset is checked first)."""
    from datasets import Dataset

    with pytest.raises(ValueError, match="prompt"):
        make_trainer(vllm_model_dir, tmp_path, dataset=Dataset.from_list([{"text": "no prompt column"}] * 8))


def test_chat_dataset_rows_reach_vllm_as_the_rendered_prompt(vllm_model_dir, tmp_path):
    trainer = make_trainer(vllm_model_dir, tmp_path, dataset=chat_dataset(tasks=False))
    rollout = generate(trainer, [0, 0, 1, 1]).rollout
    text = trainer.processing_class.decode(rollout.prompt_ids[0])
    assert text.startswith("<|im_start|>user\nSolve 0+1<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    assert rollout.messages[0][0]["role"] == "assistant" and len(rollout) == 4
