"""Engines for tests that answer with completions chosen by a fixed rule, so no sampled token can flip between
runs, and a helper that turns rows of prompt ids into requests."""

from __future__ import annotations

import torch

from grpo.base.records import Prompt, expand, group_requests
from grpo.rollout.base import assemble


def as_requests(prompt_ids, conversational=False):
    """One request per run of equal consecutive rows of token ids (a prompt's G samples)."""
    messages = ({"role": "user", "content": ""},) if conversational else None
    return group_requests([Prompt(tuple(ids), messages) for ids in prompt_ids])


class ScriptedEngine:
    """Sample j of a request gets `1 + (sum(prompt ids) + 3 j) % 8` letters (cycling through "abcdefgh" from a
    prompt-dependent offset), then the end-of-turn token; a completion of 8 letters has no stop token (truncated)."""

    name = "scripted"

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.letters = tokenizer.convert_tokens_to_ids(list("abcdefgh"))
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.syncs = 0

    def sync_weights(self, model):
        self.syncs += 1

    def completion(self, prompt_ids, j):
        n = 1 + (sum(prompt_ids) + 3 * j) % 8
        offset = sum(prompt_ids) % 8
        ids = [self.letters[(offset + k) % 8] for k in range(n)]
        return ids if n == 8 else ids + [self.end]

    def generate(self, requests):
        ids = [self.completion(r.prompt.ids, j) for r in requests for j in range(r.num_samples)]
        return assemble(expand(requests), ids, [[0.0] * len(c) for c in ids], {self.end}, self.tok)


class FixedEngine(ScriptedEngine):
    """Row i of the generation batch (all processes' rows, this process's starting at `offset`) gets
    `1 + (sum(prompt ids) + i) % 8` letters from "a", then the end-of-turn token unless it has 8."""

    def __init__(self, tokenizer, offset=0):
        super().__init__(tokenizer)
        self.offset = offset

    def generate(self, requests):
        rows = expand(requests)
        ids = []
        for i, row in enumerate(rows):
            n = 1 + (sum(row.prompt.ids) + self.offset + i) % 8
            ids.append(self.letters[:n] + ([self.end] if n < 8 else []))
        return assemble(rows, ids, [[0.0] * len(c) for c in ids], {self.end}, self.tok)


class TurnScript:
    """A multi-turn scripted engine: the text of each sampled turn is `script(prompt_text, turn, j)`, where `turn`
    counts the tool results already in the sequence and j is the sample's index in its request; the turn ends with
    the end-of-turn token unless the text ends with "~" (then it is cut there, as a truncated turn would be).
    Records the requests it got, and reports log-prob -0.5 per sampled token."""

    name = "turns"

    def __init__(self, tokenizer, script):
        self.tok = tokenizer
        self.script = script
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.requests = []

    def sync_weights(self, model):
        pass

    def turn_ids(self, text):
        if text.endswith("~"):
            return self.tok(text[:-1], add_special_tokens=False)["input_ids"]
        return self.tok(text, add_special_tokens=False)["input_ids"] + [self.end]

    def generate(self, requests):
        self.requests.append(list(requests))
        ids = []
        for r in requests:
            text = self.tok.decode(list(r.prompt.ids))
            turn = text.count("<|im_start|>tool")
            for j in range(r.num_samples):
                sampled = self.turn_ids(self.script(text, turn, j))
                ids.append(sampled[: r.max_tokens] if r.max_tokens else sampled)
        return assemble(expand(requests), ids, [[-0.5] * len(c) for c in ids], {self.end}, self.tok)


class ScoredTurnScript(TurnScript):
    """A TurnScript whose sampled tokens carry their log-probs under `model` (at `temperature`) after exactly the
    prompt each request gave: the log-probs a sampler of that model would report for them."""

    def __init__(self, tokenizer, script, model, temperature=1.0):
        super().__init__(tokenizer, script)
        self.model = model
        self.temperature = temperature

    def generate(self, requests):
        rollout = super().generate(requests)
        rows = expand(requests)
        for i, (row, ids) in enumerate(zip(rows, rollout.completion_ids)):
            if not ids:
                continue
            sequence = torch.tensor([list(row.prompt.ids) + list(ids)])
            with torch.no_grad():
                logits = self.model(input_ids=sequence).logits[0, -len(ids) - 1 : -1].float() / self.temperature
            rollout.sampling_logps[i] = logits.log_softmax(-1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()
        return rollout
