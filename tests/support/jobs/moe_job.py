"""A tiny Qwen3-MoE through colocate vLLM, run by test_vllm_engine.py in a process of its own (a mixture-of-experts
engine needs vLLM's expert-parallel group, which a process that started another engine first lacks):

    python moe_job.py OUT

The engine syncs the policy, the policy's experts change, and OUT/diff.json gets the largest difference between the
engine's and the policy's log-probs of one fixed completion before the next sync ("stale") and after it
("synced")."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/: support.*

from support import tiny  # noqa: E402
from support.vllm_runs import engine_logps, fixed_completion, make_trainer, policy_logps  # noqa: E402


def main(out: Path) -> None:
    tokenizer = tiny.make_tokenizer()
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention takes heads of 32 and 64
        num_experts=4,
        num_experts_per_tok=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(out / "moe")
    tokenizer.save_pretrained(out / "moe")
    trainer = make_trainer(str(out / "moe"), out)
    prompt, completion = fixed_completion(trainer)
    trainer.engine.sync_weights(trainer.unwrapped_model)
    with torch.no_grad():  # trained experts, not the ones the engine first packed
        for name, parameter in trainer.unwrapped_model.named_parameters():
            if "experts" in name:
                parameter.mul_(-3.0)

    def diff() -> float:
        return float(
            (engine_logps(trainer.engine, prompt, completion) - policy_logps(trainer, prompt, completion)).abs().max()
        )

    stale = diff()
    trainer.engine.sync_weights(trainer.unwrapped_model)
    (out / "diff.json").write_text(json.dumps({"stale": stale, "synced": diff()}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
