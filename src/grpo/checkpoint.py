"""Checkpoints: `<output_dir>/checkpoint-<step>`, written under a temporary name and renamed into place, so a
crash mid-write never leaves a directory that looks complete. Holds the model, tokenizer, optimizer, scheduler
and trainer state."""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import torch

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def save_pretrained(trainer: Any, output_dir: str) -> None:
    """The policy and tokenizer as a Hugging Face model directory (main process only)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    state_dict = trainer.accelerator.get_state_dict(trainer.model)
    model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
    trainer.processing_class.save_pretrained(output_dir)


def save(trainer: Any, step: int) -> str:
    root = trainer.args.output_dir
    final = os.path.join(root, f"checkpoint-{step}")
    acc = trainer.accelerator
    acc.wait_for_everyone()
    if acc.is_main_process:
        tmp = os.path.join(root, f".tmp-checkpoint-{step}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_pretrained(trainer, tmp)
        torch.save(trainer.optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
        state = {"global_step": step, "micro_step": trainer._micro_step, "max_steps": trainer.max_steps,
                 "num_input_tokens_seen": trainer.state.num_input_tokens_seen, "log_history": trainer.state.log_history,
                 "config": {k: v for k, v in trainer.args.to_dict().items() if _jsonable(v)}}
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(state, f, indent=1)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _rotate(root, trainer.args.save_total_limit)
    acc.wait_for_everyone()
    return final


def checkpoints(root: str) -> list[tuple[int, str]]:
    """Complete checkpoints under root, oldest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root)
             if (m := CHECKPOINT.match(name))]
    return sorted(found)


def _rotate(root: str, limit: int | None) -> None:
    if not limit:
        return
    for _, path in checkpoints(root)[:-limit]:
        shutil.rmtree(path, ignore_errors=True)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False
