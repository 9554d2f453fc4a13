"""The vLLM engines against the policy (the vLLM tier): a trainer with use_vllm on the small run, vLLM's and the
policy's log-probs of a fixed completion, a perturbation a sync must carry, and the tolerances they agree within."""

from __future__ import annotations

import torch
from vllm import SamplingParams

from grpo import GRPOConfig, GRPOTrainer
from support.rewards import length_reward
from support.runs import BASE, chat_dataset

FP32_TOL = 1e-3  # max |logp difference| per token, float32 engine vs float32 policy
BF16_MEAN_TOL = 0.05  # bfloat16 engine vs bfloat16 (autocast) policy: mean |difference| per token ...
BF16_MAX_TOL = 0.5  # ... and the largest one


def make_trainer(model, tmp_path, dataset=None, peft_config=None, **cfg):
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **{**BASE, "use_vllm": True, **cfg})
    return GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        train_dataset=dataset if dataset is not None else chat_dataset(tasks=False),
        args=args,
        peft_config=peft_config,
    )


def engine_logps(engine, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """vLLM's log-probs of a fixed completion (its prompt log-probs of prompt + completion)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
    out = engine.llm.generate([{"prompt_token_ids": prompt + completion}], params, use_tqdm=False)[0]
    entries = out.prompt_logprobs[len(prompt) :]
    return torch.tensor([entry[token].logprob for entry, token in zip(entries, completion)])


@torch.no_grad()
def policy_logps(trainer, prompt: list[int], completion: list[int], processors=None) -> torch.Tensor:
    """The policy's log-probs of the completion (after `processors`, as the in-process engines apply them)."""
    model = trainer.unwrapped_model
    ids = torch.tensor([prompt + completion])
    with trainer.accelerator.autocast():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    out = []
    for t, token in enumerate(completion):
        scores = logits[t : t + 1]
        if processors is not None:
            scores = processors(ids[:, : len(prompt) + t], scores)
        out.append(torch.log_softmax(scores, -1)[0, token])
    return torch.stack(out)


def fixed_completion(trainer) -> tuple[list[int], list[int]]:
    prompt = list(trainer.parts.prompts[0].ids)
    return prompt, [trainer.processing_class.convert_tokens_to_ids(c) for c in "The answer is 42."]


def perturb(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
