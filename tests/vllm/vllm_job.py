"""Training with vLLM in several processes, launched with torchrun (gloo on CPU) by test_vllm_training.py:

    torchrun --nproc_per_node N vllm_job.py OUT MODEL_DIR [ddp|fsdp|zero3][+lora] | server:PORT

Every process runs its own vLLM engine (colocate mode) inside a process that already has the trainer's gloo group.
Two optimizer steps, then every process syncs its engine once more and writes, to OUT/rank<i>.json, its engine's
log-probs of one fixed completion and the policy's (a sharded policy computes them collectively), so the test can
check that every engine holds the same weights and that they are the policy's."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from distributed_job import allow_fsdp_on_cpu  # noqa: E402
from field_effects import BASE, chat_dataset, length_reward  # noqa: E402
from grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from test_vllm_engine import engine_logps, fixed_completion, policy_logps  # noqa: E402


def main() -> None:
    out, model_dir = sys.argv[1:3]
    mode, *options = (sys.argv[3] if len(sys.argv) > 3 else "ddp").split("+")
    server = {}
    if mode.startswith("server:"):  # both processes against one `grpo vllm-serve` on that port
        server = {"vllm_mode": "server", "vllm_server_port": int(mode.split(":")[1])}
    if mode == "fsdp":
        os.environ.update(ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
        allow_fsdp_on_cpu()
    if mode == "zero3":
        os.environ.update(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="3")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    peft_config = None
    if "lora" in options:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    args = GRPOConfig(
        **{
            **BASE,
            "output_dir": out,
            "per_device_train_batch_size": 8 // world,
            "max_steps": 2,
            "use_vllm": True,
            "report_to": [],
            **server,
        }
    )
    trainer = GRPOTrainer(
        model=model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args, peft_config=peft_config
    )
    trainer.train()
    trainer.engine.sync_weights(trainer.unwrapped_model)
    prompt, completion = fixed_completion(trainer)
    row = {
        "engine": engine_logps(trainer.engine, prompt, completion).tolist() if not server else [],
        "policy": policy_logps(trainer, prompt, completion).tolist(),
        "sampling": {k: v for k, v in trainer.state.log_history[-1].items() if k.startswith("sampling/")},
        "world": world,
    }
    with open(os.path.join(out, f"rank{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump(row, f)


if __name__ == "__main__":
    main()
