"""One training run on two "machines" against a vLLM server, for test_server_nodes.py:

    accelerate launch --multi_gpu --num_machines 2 --machine_rank R --main_process_ip 127.0.0.1 \
        --main_process_port P --num_processes 2 nodes_job.py OUT MODEL_DIR SERVER_URL

(or the same with --num_machines 1 and no rank: one launch of both processes). Three steps of server-mode GRPO,
generation on the server, weights pushed through its weight-transfer engine; the main process writes the trained
weights to OUT/weights.safetensors, and every process its logged rows and completions to OUT/rank<i>.json."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/: support.*

from safetensors.torch import save_file  # noqa: E402

from grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from support.rewards import length_reward  # noqa: E402
from support.runs import BASE, chat_dataset  # noqa: E402


def main() -> None:
    out, model_dir, url = sys.argv[1:4]
    args = GRPOConfig(
        **{
            **BASE,
            "output_dir": out,
            "per_device_train_batch_size": 4,
            "max_steps": 3,
            "use_vllm": True,
            "vllm_mode": "server",
            "vllm_server_base_url": url,
            "report_to": [],
            "log_completions": True,
        }
    )
    trainer = GRPOTrainer(
        model=model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(tasks=False), args=args
    )
    completions = []
    generate = trainer.engine.generate

    def recorded(requests):
        rollout = generate(requests)
        completions.append(rollout.completion_ids)
        return rollout

    trainer.engine.generate = recorded
    trainer.train()
    rank = trainer.accelerator.process_index
    row = {
        "world": trainer.accelerator.num_processes,
        "steps": [r for r in trainer.state.log_history if "loss" in r],
        "completions": completions,
        "version": trainer.engine.version,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    if trainer.accelerator.is_main_process:
        weights = {n: p.detach().contiguous() for n, p in trainer.unwrapped_model.named_parameters()}
        save_file(weights, os.path.join(out, "weights.safetensors"))


if __name__ == "__main__":
    main()
