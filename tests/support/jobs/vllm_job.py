"""Training with vLLM in several processes, launched with torchrun (gloo on CPU) by test_vllm_training.py:

    torchrun --nproc_per_node N vllm_job.py OUT MODEL_DIR [ddp|fsdp|zero3][+lora][+tp][+server:PORT]
    torchrun --nproc_per_node N vllm_job.py OUT MODEL_DIR server:PORT[+async]

Every process runs its own vLLM engine (colocate mode) inside a process that already has the trainer's gloo group;
with `+tp`, each pair of processes shares one engine split across them (vllm_tensor_parallel_size=2), and the last
process draws extra random numbers before every step, as a trainer's work may in one process only (the engine's
shards must still sample alike). Two optimizer steps, then every process syncs its engine once more and writes, to
OUT/rank<i>.json, its engine's log-probs of one fixed completion and the policy's (a sharded policy computes them
collectively), so the test can check that every engine holds the same weights and that they are the policy's;
with `+tp`, also one more generation in which the processes ask for different numbers of rows (as a tool loop's
later turns do): each one's completions, their sampling log-probs and the policy's. With `server:PORT`, generation
is on that `grpo vllm-serve` instead of colocated engines. With `+async`:
async_generation (max_staleness 1) for four steps, with an evaluation after the third, process 1's generations starting
half a second late; every step's logged row goes to OUT/rank<i>.json too."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/: support.*

from transformers import TrainerCallback  # noqa: E402

from grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo.base.records import Request  # noqa: E402
from support.rewards import length_reward  # noqa: E402
from support.runs import BASE, chat_dataset  # noqa: E402
from support.sharded import use_deepspeed, use_fsdp  # noqa: E402
from support.vllm_runs import engine_logps, fixed_completion, policy_logps  # noqa: E402


class MoveTheRandomStream(TrainerCallback):
    """Draws random numbers in the last process only, before every step."""

    def on_step_begin(self, args, state, control, **kwargs):
        if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
            torch.rand(int(os.environ["RANK"]) + state.global_step + 3)


def main() -> None:
    out, model_dir = sys.argv[1:3]
    mode, *options = (sys.argv[3] if len(sys.argv) > 3 else "ddp").split("+")
    server = {}
    on_server = [o for o in [mode, *options] if o.startswith("server:")]
    if on_server:  # both processes against one `grpo vllm-serve` on that port (a sharded policy: every one gathers)
        server = {"vllm_mode": "server", "vllm_server_port": int(on_server[0].split(":")[1])}
    if mode == "fsdp":
        use_fsdp()
    if mode == "zero3":
        use_deepspeed(3)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    peft_config = None
    if "lora" in options:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    parallel = {"vllm_tensor_parallel_size": 2} if "tp" in options else {}
    asynchronous = "async" in options
    if asynchronous:  # four steps, an evaluation after the third (the producers stop between rounds for it)
        parallel = dict(async_generation=True, max_staleness=1, max_steps=4, eval_strategy="steps", eval_steps=3)
    args = GRPOConfig(
        **{
            **BASE,
            "output_dir": out,
            "per_device_train_batch_size": 8 // world,
            "max_steps": 2,
            "use_vllm": True,
            "report_to": [],
            **server,
            **parallel,
        }
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(tasks=False),
        args=args,
        eval_dataset=chat_dataset(4, tasks=False) if asynchronous else None,
        peft_config=peft_config,
        callbacks=[MoveTheRandomStream()] if parallel and not asynchronous else None,
    )
    if asynchronous and trainer.accelerator.process_index == 1:  # its requests start late: a server pushed to
        generate = trainer.engine.generate  # meanwhile would refuse them (409), unless the pushes wait for them

        def late(requests):
            time.sleep(0.5)
            return generate(requests)

        trainer.engine.generate = late
    trainer.train()
    trainer.engine.sync_weights(trainer.unwrapped_model)
    prompt, completion = fixed_completion(trainer)
    group = getattr(trainer.engine, "group", None)
    with group.same_random_numbers() if group is not None else contextlib.nullcontext():  # a collective
        engine = engine_logps(trainer.engine, prompt, completion).tolist() if not server else []
    row = {
        "engine": engine,
        "policy": policy_logps(trainer, prompt, completion).tolist(),
        "sampling": {k: v for k, v in trainer.state.log_history[-1].items() if k.startswith("sampling/")},
        "world": world,
        "steps": [r for r in trainer.state.log_history if "sample/staleness_mean" in r and "loss" in r],
        "evaluations": sum("eval_reward" in r for r in trainer.state.log_history),
    }
    if parallel and not asynchronous:  # process i asks for i + 1 prompts, 2 samples each
        rank = trainer.accelerator.process_index
        rollout = trainer.engine.generate([Request(trainer.parts.prompts[i], 2) for i in range(rank + 1)])
        samples = list(zip(rollout.prompt_ids, rollout.completion_ids))
        # as many policy passes in every process (a sharded policy's are collective): the last row's repeated
        policy = [policy_logps(trainer, *samples[min(i, len(samples) - 1)]).tolist() for i in range(2 * world)]
        row["rows"] = [
            {"prompt": p, "completion": c, "sampling": s, "policy": policy[i]}
            for i, (p, c, s) in enumerate(zip(rollout.prompt_ids, rollout.completion_ids, rollout.sampling_logps))
        ]
        row["asked"] = [list(trainer.parts.prompts[i].ids) for i in range(rank + 1)]
    with open(os.path.join(out, f"rank{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(row, f)


if __name__ == "__main__":
    main()
