"""Multi-turn tool rollouts under a reasoning-stripping chat template: python bench/multi_turn_tree.py [seed]

The bundled SmolLM2-135M-Instruct with a tool (`multiply`) and a ChatML template that renders every earlier assistant
turn without its reasoning block (as DeepSeek-R1's and QwQ's do), so `turn_context="auto"` samples each turn after
the rendered history. A scripted sampler writes each turn (a reasoning block of 20-60 words, then a tool call, or
the answer on the last of 1-4 turns), so the workload is the same on every machine; the tool loop, the rendering
and the training pass are grpo's own. Prints the tokens each layout computes for the same rollouts, and the training
pass (forward and backward, float32) of the tree against the forked rows:

    multi_turn_tree_vs_forked_tokens=<tree / forked rows> multi_turn_tree_vs_appended_tokens=<tree / appended rows>
    multi_turn_tree_speedup=<forked rows' pass seconds / the tree's>

Forked rows: each turn a row of its own, its rendered history as its prompt (what other trainers do to train such
histories exactly; grpo's padded layout). Appended rows: the same rollouts sampled append-only (each turn after the
tokens so far, the reasoning kept; TRL's behaviour), each row one sequence with its group's prompt counted once:
they do not train the stripped histories at all, and are the floor the tree is measured against.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

import torch
from workload import WORKLOAD

from grpo import GRPOConfig, GRPOTrainer
from grpo.agent import CHATML_TOOLS
from grpo.apps.demo_agent import multiply
from grpo.base.records import expand
from grpo.learner import tree
from grpo.learner.batch import collate
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings
from grpo.models.bundled import bundled_model_path
from grpo.rollout.base import assemble

STRIPPING = CHATML_TOOLS.replace(
    "<|im_start|>assistant\n{{ message['content'] or '' }}",
    "<|im_start|>assistant\n{{ (message['content'] or '').split('</think>')[-1] | trim }}",
)
PROMPTS, GROUP, REPEATS = 2, 4, 3
WORDS = "so the product of these two numbers needs the tool first then I check the result again".split()


class Sampler:
    """Each turn from a seeded script: a reasoning block, then a tool call (at most 3 of them, each with
    probability 0.6) or the answer; log-probs -1.0 (the bench measures the training pass, not sampling). The
    requests come in the same order whatever the turns follow, so both turn contexts get the same turns."""

    name = "scripted"

    def __init__(self, tokenizer, seed):
        self.tok = tokenizer
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.rng = random.Random(seed)

    def sync_weights(self, model):
        pass

    def turn(self, prompt_ids):
        done = self.tok.decode(list(prompt_ids)).count("<|im_start|>tool")
        reasoning = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(20, 60)))
        if done < 3 and self.rng.random() < 0.6:
            a, b = self.rng.randint(2, 99), self.rng.randint(2, 99)
            action = f'<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
        else:
            action = str(self.rng.randint(100, 9999))
        return self.tok(f"<think>{reasoning}</think>{action}", add_special_tokens=False)["input_ids"] + [self.end]

    def generate(self, requests):
        ids = [self.turn(r.prompt.ids)[: r.max_tokens] for r in requests for _ in range(r.num_samples)]
        return assemble(expand(requests), ids, [[-1.0] * len(c) for c in ids], {self.end}, self.tok)


def rollouts(turn_context: str, seed: int):
    """A trainer on the bundled model with the stripping template, and the collated rollouts of its first rows."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    path = bundled_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = STRIPPING
    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"What is {12 + k} times {34 + k}? Use the tool."}]} for k in range(8)]
    )
    overrides = dict(WORKLOAD, per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP)
    overrides.update(max_completion_length=2048, turn_context=turn_context, max_tool_calling_iterations=4)
    args = GRPOConfig(output_dir="/tmp/grpo-bench-multi-turn", disable_tqdm=True, **overrides)
    trainer = GRPOTrainer(
        model=path,
        processing_class=tok,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        train_dataset=data,
        args=args,
        tools=[multiply],
    )
    trainer.engine = Sampler(tok, seed)
    trainer.parts.producer.sync(trainer.unwrapped_model, trainer.policy_version)
    rows = [k for k in range(PROMPTS) for _ in range(GROUP)]
    rollout = trainer.parts.producer.generate(rows).rollout
    group = torch.tensor(rows)
    batch = collate(rollout, torch.randn(len(rows)), tok.pad_token_id, False, group=group)
    return trainer, batch


def forked_tokens(batch) -> int:
    rows, _, _ = tree.forked(batch)
    return int(rows.prompt_mask.sum() + rows.completion_attention.sum())


def appended_tokens(batch) -> int:
    """Each row one sequence, each group's prompt once."""
    prompts = {int(g): int(batch.prompt_mask[i].sum()) for i, g in enumerate(batch.group)}
    return sum(prompts.values()) + int(batch.completion_attention.sum())


def main() -> None:
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    trainer, rendered = rollouts("auto", seed)
    assert trainer.parts.rollouts.loop.rendered, "the stripping template should make turn_context='auto' render turns"
    _, appended = rollouts("appended", seed)
    trees = int(tree.layout(rendered).real.sum())
    forked, plain = forked_tokens(rendered), appended_tokens(appended)
    turns = [len(t) if t else 1 for t in rendered.turns]
    model, passes = trainer.model, trainer.training_pass
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(REPEATS):
        for as_trees in (False, True):
            start = time.perf_counter()
            rows = "shared_prefix" if passes.share_prefix else "padded"
            layouts = (rows, "trees") if as_trees else (rows,)
            settings = PassSettings(1.0, with_entropy=False, chunked_head=passes.chunked_head, layouts=layouts)
            logps = token_logps(model, rendered, settings).logps
            (logps * rendered.mask).sum().backward()
            seconds[as_trees].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    padded_s, tree_s = statistics.median(seconds[False]), statistics.median(seconds[True])
    result = {
        "rows": len(turns),
        "turns": sum(turns),
        "trained_tokens": int(rendered.mask.sum()),
        "tree_tokens": trees,
        "forked_tokens": forked,
        "appended_tokens": plain,
        "tree_pass_s": tree_s,
        "forked_pass_s": padded_s,
    }
    print("MULTI_TURN_RESULT " + json.dumps(result))
    print(
        f"multi_turn_tree_vs_forked_tokens={trees / forked:.2f} multi_turn_tree_vs_appended_tokens={trees / plain:.2f} "
        f"multi_turn_tree_speedup={padded_s / tree_s:.2f} ({len(turns)} rows, {sum(turns)} turns, "
        f"{result['trained_tokens']} trained tokens; float32)"
    )


if __name__ == "__main__":
    main()
