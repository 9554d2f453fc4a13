"""One GRPO step on fixed completions, launched with torchrun (gloo on CPU) by test_distributed.py:

    torchrun --nproc_per_node N distributed_job.py OUT MODEL_DIR LOSS_TYPE

Every process takes 8/N completions per micro-step, so the global batch is the same 8 completions whatever N is.
The update (SGD, linear in the gradient) and the logged metrics go to OUT (main process)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from grpo import GRPOTrainer
from test_accumulation import FixedEngine, length_reward
from test_trainer import cfg, chat_dataset


class GlobalFixedEngine(FixedEngine):
    """FixedEngine's completions, chosen by each row's index in the global batch (not the local one)."""

    def __init__(self, tokenizer, rank):
        super().__init__(tokenizer)
        self.rank = rank

    def generate(self, prompt_ids):
        n = len(prompt_ids)
        padded = [[]] * (self.rank * n) + list(prompt_ids)  # rows before this process's share
        full = super().generate(padded)
        return full.select(range(self.rank * n, self.rank * n + n))


def main() -> None:
    out, model_dir, loss_type = sys.argv[1:4]
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = cfg(Path(out), output_dir=out, per_device_train_batch_size=8 // world, loss_type=loss_type,
               shuffle_dataset=False, gradient_checkpointing=False, save_strategy="no")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-2)
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, train_dataset=chat_dataset(), args=args,
                          optimizers=(sgd, None))
    trainer.engine = GlobalFixedEngine(trainer.processing_class, trainer.accelerator.process_index)
    before = {n: p.detach().clone() for n, p in trainer.unwrapped_model.named_parameters()}
    trainer.train()
    if trainer.accelerator.is_main_process:
        update = {n: p.detach() - before[n] for n, p in trainer.unwrapped_model.named_parameters()}
        torch.save(update, os.path.join(out, "update.pt"))
        with open(os.path.join(out, "row.json"), "w") as f:
            json.dump({**trainer.state.log_history[-1], "world": trainer.accelerator.num_processes}, f)


if __name__ == "__main__":
    main()
