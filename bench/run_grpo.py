"""One grpo run of the workload, in its own process: python bench/run_grpo.py {bf16|fp32} [json overrides]."""

from __future__ import annotations

import json
import sys

from workload import WORKLOAD, TokenCounter, dataset, report, timed

from grpo import GRPOConfig, GRPOTrainer
from grpo.bundled import bundled_model_path
from grpo.demo import correctness_reward
from grpo.modeling import cpu_isa


def main() -> None:
    precision = sys.argv[1]
    overrides = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    prompts = dataset(overrides.pop("dataset", "demo"))
    counter = TokenCounter(correctness_reward)
    args = GRPOConfig(output_dir="/tmp/grpo-bench", bf16=precision == "bf16", disable_tqdm=True,
                      **{**WORKLOAD, **overrides})
    trainer = GRPOTrainer(model=bundled_model_path(), reward_funcs=counter, train_dataset=prompts, args=args)
    # vLLM starts in the constructor (as TRL's does): its start-up counts with the run, its warm-up is in train()
    seconds = timed(trainer.train) + getattr(trainer.engine, "startup_s", 0.0)
    rows = trainer.state.log_history
    generation = sum(r["timing/generation_s"] for r in rows)  # measured as run_trl.py measures TRL's
    report({"framework": "grpo", "precision": precision, "seconds": seconds, "tokens": counter.tokens,
            "step_times": [r["step_time"] for r in rows],
            "generation_tokens_per_s": counter.tokens / generation,
            "training_tokens_per_s": counter.tokens / max(seconds - generation, 1e-9),
            "engine": type(trainer.engine).__name__, "isa": cpu_isa(),
            "report_s": trainer.run_report.spent, "report_builds": trainer.run_report.builds})


if __name__ == "__main__":
    main()
