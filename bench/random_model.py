"""Random-weight models of real shapes for the GPU check (scripts/gpu_check.sh): no hub, no download.

`SHAPES["qwen2.5-0.5b"]` is Qwen2.5-0.5B's architecture (24 layers, hidden 896, 14 query and 2 key/value heads of
64, MLP 4864, qkv biases, tied head, 151,936-entry vocabulary) with transformers' random initialisation,
`SHAPES["qwen2.5-1.5b"]` Qwen2.5-1.5B's (28 layers, hidden 1536, 12 and 2 heads, MLP 8960); "tiny" is
the dry run's stand-in. The tokenizer is a character-level WordLevel one (ChatML template, <|im_end|> ending a
turn) padded with filler tokens to the vocabulary's size, so the head is the real width. A random model's next
token is close to uniform over the vocabulary, so it almost never samples EOS: every completion runs to the
length cap, a fixed workload for both frameworks.
"""

from __future__ import annotations

import importlib.util
import json
import os

SHAPES = {
    "qwen2.5-0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
}


def make_tokenizer(vocab_size: int):
    """ChatML, character-level, `vocab_size` entries (filler tokens past the characters): the tests' tiny
    tokenizer (tests/support/tiny.py, loaded from its file: tests/ itself never goes on sys.path here)."""
    spec = importlib.util.spec_from_file_location(
        "tiny", os.path.join(os.path.dirname(__file__), "..", "tests", "support", "tiny.py")
    )
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    return tiny.make_tokenizer(vocab_size)


def make_model(shape: str, device: str = "cpu", seed: int = 0):
    """A Qwen2 causal LM of `shape` with random weights, float32, built on `device`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**SHAPES[shape], pad_token_id=0, eos_token_id=1, bos_token_id=2)
    with torch.device(device):
        return Qwen2ForCausalLM(config).eval()


def save(shape: str, path: str, device: str = "cpu") -> dict:
    """Build and save the model and its tokenizer to `path` (once: an existing one is reused). Its sizes."""
    marker = os.path.join(path, "shape.json")
    if not os.path.exists(marker):
        model = make_model(shape, device)
        model.save_pretrained(path)
        make_tokenizer(SHAPES[shape]["vocab_size"]).save_pretrained(path)
        sizes = sizes_of(model)
        with open(marker, "w") as f:
            json.dump({"shape": shape, **sizes}, f)
    with open(marker) as f:
        return json.load(f)


def sizes_of(model) -> dict:
    """Parameters; the weights a decode step multiplies by (all of them with a tied head); key/value bytes per
    token in bfloat16."""
    from workload import decode_weights

    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "decode_weights": decode_weights(model),
        "kv_bytes_per_token": 2 * 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim,
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "vocab": config.vocab_size,
    }


def prompts(count: int, seed: int = 0) -> list[dict]:
    """`count` chat prompts of ~40-70 characters (one token each)."""
    import random

    rng = random.Random(seed)
    words = ["alpha", "river", "stone", "seven", "cloud", "north", "paper", "glass", "orbit", "maple"]
    return [
        {"prompt": [{"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randint(7, 11)))}]}
        for _ in range(count)
    ]


def varied_reward(completion_ids, **kwargs) -> list[float]:
    """A reward that differs between completions (the share of even token ids), so groups have advantages and
    the loss has a gradient; its value means nothing."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]
