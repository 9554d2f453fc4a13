"""A 4-step run on N CPU processes (torchrun, gloo) with the trainer's own fast engine, for test_distributed_async.py:

    torchrun --nproc_per_node N ddp_async_job.py OUT MODEL_DIR sync|async[+fsdp|+zero3] [RESUME_FROM]
    torchrun --nproc_per_node N ddp_async_job.py OUT MODEL_DIR --runs sync async again=async b=async@async/checkpoint-2

(--runs: replicated runs one after another in the same processes, a trainer each: mode M into OUT/M, or NAME=M
into OUT/NAME; NAME=M@RUN/CHECKPOINT resumes from a copy of an earlier run's checkpoint, OUT/RUN/CHECKPOINT.)

Each process takes 2 of a group's 4 completions (per_device_train_batch_size 2, num_generations 4), so with two
processes every group straddles them. A checkpoint every step (JOB_SAVE_STEPS: every that many); with RESUME_FROM
(a checkpoint's name in OUT) the run resumes from it. JOB_HANG_RANK / JOB_HANG_CALL: that process's reward function
hangs at that call (its round, from 0; "eval": its first evaluation call) after writing OUT/hung, the other's
does not. JOB_EVAL: an evaluation every 2 steps. Each process writes the completions and rewards its reward
function saw, in call order, to OUT/seen_<rank>.json; the main process writes the final parameters
(OUT/final_params.pt, gathered whole from a sharded model) and the log history. `+fsdp` /
`+zero3` shard the policy through accelerate as distributed_job.py does (FSDP2, DeepSpeed ZeRO-3)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import torch
from datasets import Dataset

import grpo.checkpoint as ckpt
from grpo import GRPOConfig, GRPOTrainer
from support.rewards import length_reward
from support.sharded import use_deepspeed, use_fsdp, whole

SEEN: list[dict] = []


def recorded_length_reward(completions, trainer_state, split=None, **kwargs):
    """support.rewards.length_reward, recorded in SEEN; slowed by JOB_REWARD_SLEEP, hung by JOB_HANG_CALL."""
    time.sleep(float(os.environ.get("JOB_REWARD_SLEEP", "0")))  # a kill test's: kills land mid-round
    hang = os.environ.get("JOB_HANG_CALL")
    due = hang == "eval" and "eval" in (split or "") or hang == str(len(SEEN))
    if os.environ.get("RANK") == os.environ.get("JOB_HANG_RANK") and due:
        open(os.path.join(sys.argv[1], "hung"), "w").close()  # this process's reward hangs, the other's does not
        time.sleep(600)
    rewards = length_reward(completions)
    SEEN.append(
        dict(step=trainer_state.global_step, completions=[c[0]["content"] for c in completions], rewards=rewards)
    )
    return rewards


def main() -> None:
    out, model_dir, mode = sys.argv[1:4]
    if mode == "--runs":
        for spec in sys.argv[4:]:
            name, _, run_mode = spec.rpartition("=")
            run_mode, _, start = run_mode.partition("@")
            assert run_mode in ("sync", "async"), f"{run_mode}: only replicated runs share a launch"
            run_out = os.path.join(out, name or run_mode)
            resume = os.path.join(run_out, os.path.basename(start)) if start else None
            if resume:  # copied by the main process, before any process's trainer reads it (an earlier run of
                # this launch set up the process group)
                assert torch.distributed.is_initialized(), "a resumed run follows a run of its own launch"
                if int(os.environ["RANK"]) == 0:
                    shutil.copytree(os.path.join(out, start), resume)
                torch.distributed.barrier()
            run(run_out, model_dir, run_mode, resume)
    else:
        run(out, model_dir, mode, os.path.join(out, sys.argv[4]) if len(sys.argv) > 4 else None)


def run(out: str, model_dir: str, mode: str, resume: str | None = None) -> None:
    SEEN.clear()
    os.makedirs(out, exist_ok=True)
    mode, _, sharded = mode.partition("+")
    if sharded == "fsdp":
        use_fsdp()
    if sharded == "zero3":
        use_deepspeed(3)
    rows = [{"prompt": [{"role": "user", "content": f"Solve {i}+1"}]} for i in range(8)]
    evaluating = (
        dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2) if "JOB_EVAL" in os.environ else {}
    )
    args = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=2,
        num_generations=4,
        max_completion_length=8,
        max_steps=4,
        save_steps=int(os.environ.get("JOB_SAVE_STEPS", "1")),
        learning_rate=1e-2,
        logging_steps=1,
        disable_tqdm=True,
        bf16=False,
        seed=0,
        gradient_checkpointing=False,
        run_report=False,
        ddp_backend="gloo",
        async_generation=mode == "async",
        max_staleness=1,
        **evaluating,
    )
    data = Dataset.from_list(rows)
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=recorded_length_reward,
        train_dataset=data,
        eval_dataset=Dataset.from_list([{**row, "split": "eval"} for row in rows[:2]]) if evaluating else None,
        args=args,
    )
    trainer.train(resume_from_checkpoint=resume)
    rank = trainer.accelerator.process_index
    with open(os.path.join(out, f"seen_{rank}.json"), "w") as f:
        json.dump(SEEN, f)
    final = (
        whole(trainer.unwrapped_model) if sharded else ckpt.model_state(trainer.model, trainer.accelerator)
    )  # whole: a collective
    if trainer.accelerator.is_main_process:
        torch.save(final, os.path.join(out, "final_params.pt"))
        with open(os.path.join(out, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)


if __name__ == "__main__":
    main()
