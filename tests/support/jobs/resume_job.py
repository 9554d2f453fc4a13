"""A 6-step training run for the resume tests, run as its own process:

    python resume_job.py OUT MODEL_DIR SPG RESUME [--pause-after N] [--block-writing N] [--term-at N]

--pause-after N: once checkpoint-N is complete, print SAVED and wait (to be killed with SIGKILL);
--block-writing N: while writing checkpoint-N, print WRITING and wait (a kill mid-write);
--term-at N: send this process SIGTERM at the end of step N (preemption between steps);
--hang-reward-at N: the reward function never returns in step N (print HUNG first; the test sends SIGTERM);
--zero N: under DeepSpeed ZeRO stage N, as `accelerate launch --use_deepspeed --zero_stage N` sets it up (launch
  with torchrun);
--stop-after N: once checkpoint-N is complete, every process ends at once (os._exit: no cleanup, as if killed).
At the end the final parameters go to OUT/final_params.pt (whole, from the main process)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
from datasets import Dataset

import grpo.checkpoint as ckpt
from grpo import GRPOConfig, GRPOTrainer
from support.rewards import length_reward

HANG_AT = 0


def hanging_length_reward(completions, trainer_state, **kwargs):
    """support.rewards.length_reward, which never returns in step HANG_AT (--hang-reward-at)."""
    if trainer_state.global_step + 1 == HANG_AT:
        hang("HUNG")
    return length_reward(completions)


def hang(message: str) -> None:
    print(message, flush=True)
    while True:
        time.sleep(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("model")
    p.add_argument("spg", type=int)
    p.add_argument("resume", type=int)
    p.add_argument("--pause-after", type=int, default=0)
    p.add_argument("--block-writing", type=int, default=0)
    p.add_argument("--term-at", type=int, default=0)
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--stop-after", type=int, default=0)
    p.add_argument("--hang-reward-at", type=int, default=0)
    o = p.parse_args()
    global HANG_AT
    HANG_AT = o.hang_reward_at
    if o.zero:
        from support.sharded import use_deepspeed

        use_deepspeed(o.zero)
    torch.set_num_threads(1)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Solve {i}+1"}]} for i in range(8)])
    args = GRPOConfig(
        output_dir=o.out,
        max_steps=6,
        save_steps=3,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-2,
        logging_steps=1,
        disable_tqdm=True,
        bf16=False,
        seed=0,
        steps_per_generation=o.spg,
        gradient_checkpointing=False,
    )
    if o.pause_after or o.stop_after:
        save = ckpt.save

        def save_then_pause(run, step, window):
            path = save(run, step, window)
            if step == o.pause_after:
                hang("SAVED")
            if step == o.stop_after:
                os._exit(0)
            return path

        ckpt.save = save_then_pause
    if o.block_writing:
        save_pretrained = ckpt.save_pretrained

        def write_then_block(run, output_dir, state_dict):
            save_pretrained(run, output_dir, state_dict)
            if f"tmp-checkpoint-{o.block_writing}" in output_dir:
                hang("WRITING")

        ckpt.save_pretrained = write_then_block
    trainer = GRPOTrainer(model=o.model, reward_funcs=hanging_length_reward, train_dataset=data, args=args)
    if o.term_at:
        step = trainer._step

        def step_with_sigterm():
            loss = step()
            if trainer.state.global_step == o.term_at:  # between steps (inside one: the hung-reward test)
                os.kill(os.getpid(), signal.SIGTERM)
            return loss

        trainer._step = step_with_sigterm
    trainer.train(resume_from_checkpoint=bool(o.resume) or None)
    state = ckpt.model_state(trainer.model, trainer.accelerator)  # every process: gathered when partitioned
    if trainer.accelerator.is_main_process:
        torch.save(state, os.path.join(o.out, "final_params.pt"))
    sys.exit(0)


if __name__ == "__main__":
    main()
