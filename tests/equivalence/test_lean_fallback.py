"""Models and LoRA configs the lean decoder half-understands: each is named by `lean_families.unsupported_reason`,
the reason is logged, and the fast engine samples through the model's own forward (`_TransformersStepper`): the
tokens and log-probs of the stepper, never a crash or the lean decoder's wrong numbers. Each case is one where the
lean decoder, made to run it anyway, would compute something else than the model's forward (or fail), so a reason
missed fails the test; and the LoRA settings it does merge (rank and alpha patterns) keep the lean path, with the
stepper's numbers."""

from __future__ import annotations

import pytest
import torch

from grpo.algo.sampling import SamplingSettings
from grpo.base.records import left_pad
from grpo.data.prompts import end_of_turn_ids, tokenize_prompts
from grpo.rollout.fast import FastEngine
from grpo.rollout.lean_decoder import LeanDecoder
from grpo.rollout.lean_families import unsupported_reason
from support.scripted import as_requests
from support.tiny import make_model, make_tokenizer, with_lora


class FakeQuantLinear(torch.nn.Linear):
    """A quantized projection as bitsandbytes or torchao make them: a Linear subclass whose forward rounds its
    weight to an 8-bit grid (per output row), so `weight` alone is not what it computes with."""

    def forward(self, x):
        step = self.weight.abs().amax(1, keepdim=True) / 7
        return torch.nn.functional.linear(x, (self.weight / step).round() * step, self.bias)


def _quantized_projection(model):
    attn = model.model.layers[0].self_attn
    quant = FakeQuantLinear(attn.q_proj.in_features, attn.q_proj.out_features, bias=False)
    quant.load_state_dict(attn.q_proj.state_dict())
    attn.q_proj = quant
    return model


def _custom_attention_bias(model):
    """An extra bias the attention module adds to its output (custom modelling code): a parameter the lean
    decoder would not read."""
    attn = model.model.layers[0].self_attn
    attn.out_bias = torch.nn.Parameter(torch.randn(model.config.hidden_size) * 0.5)
    original = attn.forward

    def forward(hidden_states, *args, **kwargs):
        out, weights = original(hidden_states, *args, **kwargs)
        return out + attn.out_bias, weights

    attn.forward = forward
    return model


def _layer_norm(model):
    layer = model.model.layers[1]
    norm = torch.nn.LayerNorm(model.config.hidden_size)
    with torch.no_grad():
        norm.bias.normal_(0, 0.5)
    layer.input_layernorm = norm
    return model


def _unknown_rope(model):
    model.config.rope_parameters = {"rope_type": "proportional", "rope_theta": 10000.0, "factor": 2.0}
    return model


def _quantization_config(model):
    model.config.quantization_config = {"quant_method": "fp8", "weight_block_size": [8, 8]}
    return model


def _dora(model):
    return with_lora(model, target_modules=["q_proj", "v_proj"], use_dora=True)


def _embedding_rank_pattern(model):
    """A rank pattern whose targets include the input embedding, which the lean decoder does not merge."""
    model = with_lora(model, target_modules=["q_proj", "embed_tokens"], rank_pattern={"embed_tokens": 4, "q_proj": 2})
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_embedding_" in name:  # PEFT starts an embedding adapter at zero
                param.normal_(0, 0.5)
    return model


# case -> (how the tiny Llama is changed, what the reason says, whether the lean decoder forced on it errs)
HALF_UNDERSTOOD = {
    "unknown rope type": (_unknown_rope, "rotary type 'proportional' is not one the lean decoder knows", False),
    "quantization_config": (_quantization_config, "the model is quantized (fp8)", False),
    "quantized projection": (_quantized_projection, "FakeQuantLinear, not a plain torch Linear", True),
    "custom attention bias": (_custom_attention_bias, "does not read (model.layers.0.self_attn.out_bias)", True),
    "norm with a bias": (_layer_norm, "a norm of the model is a LayerNorm", True),
    "DoRA": (_dora, "LoRA adapter 'default' is a variant (DoRA", True),
    "rank pattern on the embedding": (_embedding_rank_pattern, "input embedding is a Embedding", True),
}


def _setting(model, tok):
    args = SamplingSettings(max_completion_length=12)
    stop = end_of_turn_ids(tok, model.generation_config.eos_token_id)
    chats = [[{"role": "user", "content": text}] for text in ("hi", "what is two plus two?")]
    return args, stop, as_requests([ids for ids in tokenize_prompts(chats, tok) for _ in range(3)])


def _lean_errs(model, tok):
    """Whether the lean decoder, made to run this model anyway, gives other next-token logits than the model's own
    forward (or fails)."""
    ids, mask = left_pad([tokenize_prompts([[{"role": "user", "content": "hi"}]], tok)[0]], tok.pad_token_id)
    with torch.no_grad():
        expected = model(input_ids=ids).logits[:, -1].float()
        try:
            got = LeanDecoder(model, torch.float32).prefill(ids, mask, torch.tensor([0]), max_new=2)
        except Exception:  # noqa: BLE001 (any failure is what the reason spares the user)
            return True
    return not torch.allclose(got, expected, rtol=1e-4, atol=1e-4)


def _rollouts(model, tok, **kw):
    args, stop, requests = _setting(model, tok)
    out = []
    for lean in (True, False):
        torch.manual_seed(0)
        out.append(FastEngine(model, tok, args, stop, lean=lean, **kw).generate(requests))
    return out


@pytest.mark.parametrize("case", list(HALF_UNDERSTOOD))
def test_what_the_lean_path_half_understands_is_named_and_sampled_by_the_model_itself(case, caplog):
    change, says, lean_errs = HALF_UNDERSTOOD[case]
    tok = make_tokenizer()
    model = change(make_model(tok, hidden=64)).eval()
    reason = unsupported_reason(model)
    assert reason is not None and says in reason, reason
    if lean_errs:  # the reason is what keeps the wrong numbers (or the crash) away
        assert _lean_errs(model, tok)
    with caplog.at_level("INFO", logger="grpo"):
        fast, stepper = _rollouts(model, tok)
    assert f"Sampling with the transformers forward: {reason}." in caplog.messages
    assert fast.completion_ids == stepper.completion_ids and fast.sampling_logps == stepper.sampling_logps
    assert any(fast.completion_ids)


def test_lora_rank_and_alpha_patterns_are_merged_on_the_lean_path():
    """Rank and alpha patterns on the projections the lean decoder reads change each layer's scaling, which its
    merged copies apply: the lean path runs, with the stepper's tokens and log-probs (float32)."""
    tok = make_tokenizer()
    model = with_lora(
        make_model(tok, hidden=64),
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"q_proj": 4},
        alpha_pattern={"down_proj": 64},
    ).eval()
    assert unsupported_reason(model) is None
    assert not _lean_errs(model, tok)
    fast, stepper = _rollouts(model, tok, sampler=lambda logprobs: logprobs.argmax(-1))
    assert fast.completion_ids == stepper.completion_ids
    for a, b in zip(fast.sampling_logps, stepper.sampling_logps):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-5)
