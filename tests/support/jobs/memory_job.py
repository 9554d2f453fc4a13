"""Peak memory of one training log-prob/entropy pass (forward and backward), run in its own process by
test_memory.py:

    python memory_job.py ROWS COMPLETION_LENGTH VOCAB CHUNKED

Prints `logits_bytes=<B*T*V*4> peak_increase=<bytes>`: the process's peak RSS (VmHWM) after the pass minus its
RSS just before it (an upper bound on what the pass itself held at once). VmHWM, not getrusage's ru_maxrss:
the latter survives exec and so can report the forking parent's size."""

from __future__ import annotations

import resource
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from grpo.base.records import Rollout
from grpo.learner.batch import collate
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main() -> None:
    rows, length, vocab, chunked = (int(x) for x in sys.argv[1:5])
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * length,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    completions = torch.randint(5, vocab, (rows, length)).tolist()
    rollout = Rollout(
        prompt_ids=[[1, 2, 3, 4]] * rows,
        completion_ids=completions,
        sampling_logps=[[0.0] * length] * rows,
        truncated=[False] * rows,
    )
    batch = collate(rollout, torch.ones(rows), 0, mask_truncated=False)
    before = rss_bytes()
    scored = token_logps(model, batch, PassSettings(1.0, with_entropy=True, chunked_head=bool(chunked)))
    logps, entropies = scored.logps, scored.entropies
    (logps.sum() + entropies.sum()).backward()
    peak = peak_rss_bytes()
    print(f"logits_bytes={rows * length * vocab * 4} peak_increase={peak - before}")


if __name__ == "__main__":
    main()
