"""The lean decoder on the families users train, against the transformers forward it replaces (`make bench` rows).

For each family, a float32 decode of `ROWS` rows on one model, `STEPS` steps after `WARMUP`, measured twice in this
process: through grpo's lean decoder (`grpo.rollout.lean_decoder.LeanDecoder`, the panel kernel where it runs) and
through `_TransformersStepper` (one transformers forward per token with a DynamicCache: what the fast engine runs for
a model the lean decoder does not take). Each prints one line:

    <family>: decode_tokens_s=<lean> stepper_tokens_s=<stepper> decode_vs_bound=<ratio> vs_stepper=<ratio>

- `decode_vs_bound` = the lean step's time / the time to read every weight a step multiplies by once, in float32, at
  the bandwidth of a streaming read measured now (bounds.py); 1.0 would be the machine's limit.
- `vs_stepper` = lean tokens/s / stepper tokens/s.

Families: `qwen3`, a random Qwen3-0.6B-shaped model (28 layers, hidden 1024, 16 query and 8 key/value heads of
128, per-head query/key norms, tied 151,936-entry head); `lora`, the bundled SmolLM2-135M-Instruct with LoRA
adapters (r=16 on every linear, lora_B drawn at random), and `bundled`, the same model without them (the
reference for `lora`); `gemma3`, a random Gemma-3-1B-shaped model (sliding layers of 512 beside full ones). A
family the lean decoder does not take prints its reason instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bounds  # noqa: E402

from grpo.rollout import lean_decoder, lean_families  # noqa: E402
from grpo.rollout.fast import _TransformersStepper  # noqa: E402

ROWS, PROMPT, WARMUP, STEPS = 16, 32, 4, 24


def qwen3(small: bool) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    shape = dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    if small:
        shape.update(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)
    return Qwen3ForCausalLM(Qwen3Config(**shape))


def gemma3(small: bool) -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    shape = dict(
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=512,
        max_position_embeddings=4096,
    )
    if small:
        shape.update(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16)
    return Gemma3ForCausalLM(Gemma3TextConfig(**shape))


def bundled(small: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from grpo.models.bundled import bundled_model_path

    if small:
        torch.manual_seed(0)
        return LlamaForCausalLM(
            LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        )
    return AutoModelForCausalLM.from_pretrained(bundled_model_path(), dtype=torch.float32)


def lora(small: bool) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(bundled(small), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return model


FAMILIES = {"qwen3": qwen3, "gemma3": gemma3, "lora": lora, "bundled": bundled}


def step_weights(model: torch.nn.Module) -> int:
    """The numbers a decode step multiplies by: every Linear's weight in the decoder layers and the head (a LoRA
    layer's merged copy counts as its base weight; the embedding is a lookup)."""
    from grpo.models.lora import active_module
    from grpo.models.modeling import unwrap

    inner = unwrap(model)
    total = sum(m.weight.numel() for m in inner.model.layers.modules() if type(m) is torch.nn.Linear)
    return total + active_module(inner.lm_head).weight.numel()


def decode_s(stepper, vocab: int) -> float:
    """Seconds per decode step of `stepper` on ROWS rows: a prefill of PROMPT tokens, WARMUP steps, then STEPS timed."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (ROWS, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        stepper.prefill(ids, mask, torch.arange(ROWS), max_new=WARMUP + STEPS + 1)
        tokens = torch.randint(0, vocab, (WARMUP + STEPS, ROWS), generator=g)
        for t in tokens[:WARMUP]:
            stepper.step(t)
        start = time.perf_counter()
        for t in tokens[WARMUP:]:
            stepper.step(t)
        return (time.perf_counter() - start) / STEPS


def run(family: str, small: bool) -> str:
    model = FAMILIES[family](small).eval()
    reason = lean_families.unsupported_reason(model)
    if reason is not None:
        return f"{family}: not run on the lean decoder ({reason})"
    vocab = model.config.vocab_size if hasattr(model, "config") else 1024
    weights = step_weights(model)
    lean = decode_s(lean_decoder.LeanDecoder(model, torch.float32), vocab)
    plain = decode_s(_TransformersStepper(model), vocab)
    bandwidth = max(bounds.read_bandwidth(4 * weights) for _ in range(3))
    return (
        f"{family}: decode_tokens_s={ROWS / lean:.1f} stepper_tokens_s={ROWS / plain:.1f} "
        f"decode_vs_bound={bounds.decode_vs_bound(lean, weights, bandwidth):.2f} vs_stepper={plain / lean:.2f} "
        f"(step {1e3 * lean:.1f} ms, stepper {1e3 * plain:.1f} ms, bound {1e3 * 4 * weights / bandwidth:.1f} ms "
        f"at {bandwidth / 1e9:.1f} GB/s, {weights / 1e6:.0f}M weights, {ROWS} rows)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=list(FAMILIES), action="append", help="default: every family")
    parser.add_argument("--small", action="store_true", help="tiny models of each family (a smoke test)")
    args = parser.parse_args()
    for family in args.family or list(FAMILIES):
        print(run(family, args.small), flush=True)


if __name__ == "__main__":
    main()
