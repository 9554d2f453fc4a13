"""One grpo run of the workload, in its own process: python bench/run_grpo.py {bf16|fp32} [json overrides].
Overrides are GRPOConfig fields, and `dataset` (workload.dataset's names), `model` (a model directory; default
the bundled SmolLM2-135M-Instruct), `lora` (a rank: LoRA adapters on every linear layer, alpha twice the rank, no
dropout) and `lean` (false: the fast engine decodes through the transformers forward, the baseline of lora_run.py)."""

from __future__ import annotations

import json
import sys

from workload import WORKLOAD, TokenCounter, dataset, decode_weights, peak_memory, report, timed

from grpo import GRPOConfig, GRPOTrainer
from grpo.data.prompts import tokenize_prompts
from grpo.models.bundled import bundled_model_path
from grpo.models.modeling import cpu_isa


class StepCounter(TokenCounter):
    """Also, per generation batch (one a step here): its decode steps (the fast engine runs until its longest
    completion ends) and the tokens its training pass must run (each group's prompt once, every completion token)."""

    def __init__(self, reward, group: int):
        super().__init__(reward)
        self.group, self.tokenizer = group, None
        self.decode_steps, self.completion_tokens, self.train_tokens = [], [], []

    def __call__(self, completions, completion_ids, prompts, **kwargs):
        lengths = [len(ids) for ids in completion_ids]
        prompt_tokens = sum(len(ids) for ids in tokenize_prompts(prompts[:: self.group], self.tokenizer))
        self.decode_steps.append(max(lengths))
        self.completion_tokens.append(sum(lengths))
        self.train_tokens.append(prompt_tokens + sum(lengths))
        return super().__call__(completions=completions, completion_ids=completion_ids, prompts=prompts, **kwargs)


def main() -> None:
    precision = sys.argv[1]
    overrides = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    prompts, reward = dataset(overrides.pop("dataset", "demo"))
    model = overrides.pop("model", None) or bundled_model_path()
    rank = overrides.pop("lora", 0)
    peft_config = None
    if rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear")
    if not overrides.pop("lean", True):
        from grpo.rollout import lean_families

        lean_families.unsupported_reason = lambda model: "turned off (the benchmark's baseline)"
    args = GRPOConfig(
        output_dir="/tmp/grpo-bench", bf16=precision == "bf16", disable_tqdm=True, **{**WORKLOAD, **overrides}
    )
    counter = StepCounter(reward, args.num_generations)
    trainer = GRPOTrainer(model=model, reward_funcs=counter, train_dataset=prompts, args=args, peft_config=peft_config)
    counter.tokenizer = trainer.parts.tokenizer
    # vLLM starts in the constructor (as TRL's does): its start-up counts with the run, its warm-up is in train()
    seconds = timed(trainer.train) + getattr(trainer.engine, "startup_s", 0.0)
    rows = trainer.state.log_history
    generation = sum(r["timing/generation_s"] for r in rows)  # measured as run_trl.py measures TRL's
    # the training pass (forward, loss, backward) of each step, from the tokens/s the trainer logs for it
    passes = [n / r["timing/training_tokens_per_s"] for n, r in zip(counter.completion_tokens, rows)]
    # tokens of the rounds trained (an async producer may have generated a round ahead that no step took)
    trained = len([r for r in rows if "timing/generation_s" in r])
    report(
        {
            "framework": "grpo",
            "precision": precision,
            "seconds": seconds,
            "tokens": sum(counter.completion_tokens[:trained]),
            "learner_wait_s": sum(r.get("timing/learner_wait_s", 0.0) for r in rows),
            "producer_wait_s": sum(r.get("timing/producer_wait_s", 0.0) for r in rows),
            "step_times": [r["step_time"] for r in rows],
            "generation_tokens_per_s": counter.tokens / generation,
            "training_tokens_per_s": counter.tokens / max(seconds - generation, 1e-9),
            "engine": type(trainer.engine).__name__,
            "isa": cpu_isa(),
            "report_s": trainer.parts.run_report.spent,
            "report_builds": trainer.parts.run_report.builds,
            "generation_s": [r["timing/generation_s"] for r in rows],
            "decode_steps": counter.decode_steps,
            "completion_tokens": counter.completion_tokens,
            "train_pass_s": passes,
            "train_tokens": counter.train_tokens,
            "decode_weights": decode_weights(trainer.unwrapped_model),
            **peak_memory(),
        }
    )


if __name__ == "__main__":
    main()
