"""One TRL run of the same workload, in its own process: python bench/run_trl.py {bf16|fp32} [json overrides].
TRL is installed only for the benchmark (the `bench` extra); grpo never imports it. Overrides as run_grpo.py's;
`use_cpu` defaults to True (the CPU benchmark), False on a GPU."""

from __future__ import annotations

import json
import sys
import time

from workload import WORKLOAD, TokenCounter, dataset, peak_memory, report, timed

from grpo.models.bundled import bundled_model_path
from grpo.models.modeling import cpu_isa


def main() -> None:
    from trl import GRPOConfig, GRPOTrainer

    precision = sys.argv[1]
    overrides = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    prompts, reward = dataset(overrides.pop("dataset", "demo"))
    model = overrides.pop("model", None) or bundled_model_path()
    counter = TokenCounter(reward)
    args = GRPOConfig(
        output_dir="/tmp/trl-bench",
        bf16=precision == "bf16",
        disable_tqdm=True,
        **{**WORKLOAD, "use_cpu": True, **overrides},
    )
    trainer = GRPOTrainer(model=model, reward_funcs=counter, train_dataset=prompts, args=args)
    generation = {"seconds": 0.0}
    original = trainer._generate  # time TRL's generation phase to split generation from training

    def timed_generate(*a, **kw):
        start = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            generation["seconds"] += time.perf_counter() - start

    trainer._generate = timed_generate
    seconds = timed(trainer.train)
    gen = generation["seconds"]
    report(
        {
            "framework": "trl",
            "precision": precision,
            "seconds": seconds,
            "tokens": counter.tokens,
            "step_times": [r.get("step_time") for r in trainer.state.log_history if "step_time" in r],
            "generation_tokens_per_s": counter.tokens / gen if gen else None,
            "training_tokens_per_s": counter.tokens / max(seconds - gen, 1e-9),
            "engine": "transformers",
            "isa": cpu_isa(),
            **peak_memory(),
        }
    )


if __name__ == "__main__":
    main()
