"""GRPO in server mode: generation on vLLM servers, weights pushed to them after every optimizer step.

    grpo vllm-serve --model Qwen/Qwen2.5-0.5B-Instruct                  # a server, on 127.0.0.1:8000
    python examples/server_mode_train.py                                 # one process
    accelerate launch --multi_gpu --num_processes 8 examples/server_mode_train.py
    GRPO_SERVER_URL=http://a:8000,http://b:8000 python examples/server_mode_train.py   # several servers

On a cluster, examples/server_mode.sbatch starts a server node and the trainer nodes (docs/server.md).
"""

import os

from datasets import load_dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.rewards import accuracy_reward

MODEL = os.environ.get("MODEL", "Qwen/Qwen2.5-0.5B-Instruct")

args = GRPOConfig(
    output_dir=os.environ.get("OUTPUT_DIR", "runs/server-mode"),
    use_vllm=True,
    vllm_mode="server",
    vllm_server_base_url=os.environ.get("GRPO_SERVER_URL", "http://127.0.0.1:8000"),
    per_device_train_batch_size=8,
    num_generations=8,
    max_completion_length=512,
    bf16=True,
    logging_steps=1,
    save_strategy="steps",
    save_steps=50,
)
dataset = load_dataset("trl-lib/DeepMath-103K", split="train")
trainer = GRPOTrainer(model=MODEL, reward_funcs=accuracy_reward, train_dataset=dataset, args=args)
trainer.train()
