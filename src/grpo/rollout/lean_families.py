"""Which models the lean decoder (`grpo.rollout.lean_decoder`) runs, read from their configs and modules: the
families it knows (`SUPPORTED`), why it cannot run a model (`unsupported_reason`), why the fixed-shape loop cannot
(`fixed_shape_reason`), and the facts of a layer it reads (its sliding window, its linears, its norms and a norm's
epsilon)."""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from grpo.models import lora
from grpo.models.lora import active_module
from grpo.models.modeling import unwrap

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "phi3", "olmo2", "gemma3_text")
OLMO = ("olmo2",)  # norms after each sublayer (none before), query/key norms over the whole projection
# the rotary types whose numbers are a function of each token's position alone (longrope and the dynamic kinds change
# with the length of the sequence: one forward and a token-by-token decode would rotate differently)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
LENGTH_ROPE = ("dynamic", "longrope")
GEMMA = ("gemma3_text",)  # sandwich norms of 1 + weight, scaled embeddings, GELU, sliding-window layers


def unsupported_reason(model: Any) -> str | None:
    """Why `LeanDecoder` cannot run this model (None when it can): a family it does not know, settings of a known
    family it does not run (quantized weights, a rotary type of another kind, other activations or attention types),
    modules other than the ones it reads (a projection that is not a plain Linear or a LoRA adapter it merges, norms
    that are not the family's RMSNorm) or a parameter it would not read (a custom bias): the model then keeps its own
    forward, which computes all of these."""
    model = unwrap(model)
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        return f"model type {kind!r} is not one the lean decoder knows ({', '.join(SUPPORTED)})"
    reason = _settings_reason(model, config, kind)
    if reason is not None:
        return reason
    inner = getattr(model, "model", None)
    head = active_module(getattr(model, "lm_head", None))
    if (
        inner is None
        or not hasattr(inner, "rotary_emb")
        or not (isinstance(head, torch.nn.Linear) or lora.lean_problem(head) is None)
    ):
        return "the model does not have the usual Llama layout"
    embedding = type(active_module(inner.embed_tokens))
    if embedding is not torch.nn.Embedding and not (
        kind in GEMMA and embedding.__name__ == "Gemma3TextScaledWordEmbedding"
    ):
        return f"its input embedding is a {embedding.__qualname__}, not a plain torch Embedding (a LoRA adapter on it?)"
    for layer in inner.layers:
        reason = _layer_reason(layer, config, kind in OLMO)
        if reason is not None:
            return reason
    final = active_module(inner.norm)
    if not type(final).__name__.endswith("RMSNorm") or math.isnan(norm_eps(final)):
        return f"a norm of the model is a {type(final).__qualname__}, not the RMSNorm the lean decoder knows"
    return _unread_parameter(model)


def _settings_reason(model: Any, config: Any, kind: str) -> str | None:
    """Why the settings of a family the lean decoder knows are not ones it runs (None: they are)."""
    quantized = getattr(config, "quantization_config", None) or getattr(model, "hf_quantizer", None)
    if quantized:
        method = (
            quantized.get("quant_method") if isinstance(quantized, dict) else getattr(quantized, "quant_method", None)
        )
        return f"the model is quantized ({method or type(quantized).__name__}); the lean decoder reads plain weights"
    if kind in GEMMA:
        reason = _gemma_reason(config)
        if reason is not None:
            return reason
    else:
        if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "pretraining_tp", 1) != 1:
            return "the model uses a non-default activation or tensor-parallel split"
        layer_types = set(getattr(config, "layer_types", None) or ())
        if layer_types - {"full_attention", "sliding_attention"}:
            return f"the model has layers of other attention types ({', '.join(sorted(layer_types))})"
    rope = _rope_type(config)
    if set(rope.split(",")) & set(LENGTH_ROPE):
        return f"the model's rotary embedding ({rope}) changes with the sequence's length"
    if not set(rope.split(",")) <= set(STATIC_ROPE):
        return f"the model's rotary type {rope!r} is not one the lean decoder knows ({', '.join(STATIC_ROPE)})"
    return None


def _layer_reason(layer: Any, config: Any, olmo: bool) -> str | None:
    """Why the lean decoder cannot run this decoder layer's modules (None: it can)."""
    attn, mlp = layer.self_attn, layer.mlp
    for proj in _projections(attn, mlp):
        problem = lora.lean_problem(proj)
        if problem is not None:
            return problem
    norms = [active_module(getattr(attn, name, None)) for name in ("q_norm", "k_norm")]
    if (norms[0] is None) != (norms[1] is None) or (
        norms[0] is not None
        and (
            not all(not math.isnan(norm_eps(n)) and hasattr(n, "weight") for n in norms)
            or norm_eps(norms[0]) != norm_eps(norms[1])
            or [tuple(n.weight.shape) for n in norms] != _norm_shapes(attn, config, olmo)
        )
    ):
        return "the model's query/key norms are not the RMSNorm pair (of one epsilon) the lean decoder knows"
    for name in NORM_NAMES:
        norm = active_module(getattr(layer, name, None))
        if norm is not None and (not type(norm).__name__.endswith("RMSNorm") or math.isnan(norm_eps(norm))):
            return f"a norm of the model is a {type(norm).__qualname__}, not the RMSNorm the lean decoder knows"
    return None


NORM_NAMES = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj")
# the parameters the lean decoder reads, by name (a layer's number as N), PEFT's own segments dropped
READ = re.compile(
    "|".join(
        [
            r"model\.(embed_tokens|norm)\.weight",
            rf"model\.layers\.N\.(self_attn|mlp)\.({'|'.join(LINEAR_NAMES)})\.(weight|bias)",
            r"model\.layers\.N\.self_attn\.[qk]_norm\.weight",
            rf"model\.layers\.N\.({'|'.join(NORM_NAMES)})\.weight",
            r"lm_head\.(weight|bias)",
        ]
    )
)
PEFT_SEGMENTS = {"base_layer", "original_module"}  # dropped alone
PEFT_NAMED = {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "modules_to_save"}  # dropped with the adapter


def _unread_parameter(model: Any) -> str | None:
    """A parameter that the lean decoder would not read, which the model's forward does (a custom bias, an
    attention sink, a quantization scale): the model then keeps its own forward."""
    for name, _ in model.named_parameters():
        parts, skip = [], False
        for part in name.split("."):
            if skip:
                skip = False
            elif part in PEFT_NAMED:
                skip = True
            elif part not in PEFT_SEGMENTS:
                parts.append("N" if part.isdigit() else part)
        if not READ.fullmatch(".".join(parts)):
            return f"the model has a parameter the lean decoder does not read ({name})"
    return None


def _norm_shapes(attn: Any, config: Any, olmo: bool) -> list[tuple[int]]:
    """The query and key norms' weight shapes the lean decoder runs: per head (Qwen3, Gemma 3) or, for OLMo 2, over
    the whole query and key projections."""
    head_dim = getattr(attn, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if not olmo:
        return [(head_dim,), (head_dim,)]
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return [(config.num_attention_heads * head_dim,), (kv_heads * head_dim,)]


def _gemma_reason(config: Any) -> str | None:
    """Why a Gemma 3 text model's settings are not the ones the lean decoder runs (None: they are)."""
    if getattr(config, "hidden_activation", None) != "gelu_pytorch_tanh":
        return f"the model's activation {getattr(config, 'hidden_activation', None)!r} is not Gemma's tanh GELU"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "the model soft-caps its attention scores (attn_logit_softcapping)"
    if getattr(config, "use_bidirectional_attention", False):
        return "the model attends both ways (use_bidirectional_attention)"
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - {"full_attention", "sliding_attention"}:
        return f"the model has layers of other attention types ({', '.join(sorted(layer_types))})"
    return None


def fixed_shape_reason(model: Any) -> str | None:
    """Why the fixed-shape loop (`graphed.StaticDecode`) cannot run this model's lean decoder (None when it can):
    it runs the Llama layer only, every layer rotated, over every key."""
    model = unwrap(model)
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) in GEMMA:
        return "Gemma 3's layers (sandwich norms, sliding windows) take the per-step loop"
    if getattr(config, "model_type", None) in OLMO:
        return "OLMo 2's layers (norms after each sublayer) take the per-step loop"
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    if any(window(layer.self_attn, config) for layer in layers):
        return "sliding-window layers take the per-step loop"
    if not all(getattr(layer.self_attn, "use_rope", True) for layer in layers):
        return "layers without rotary embeddings take the per-step loop"
    return None


def _projections(attn: Any, mlp: Any) -> list[Any]:
    """A layer's linears (Phi-3's fused q/k/v and gate/up, or the Llama layer's seven)."""
    qkv = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
    gate_up = [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
    return [*qkv, attn.o_proj, *gate_up, mlp.down_proj]


def _rope_type(config: Any) -> str:
    """The config's rotary type (transformers 5's `rope_parameters`, or an older `rope_scaling`)."""
    for name in ("rope_parameters", "rope_scaling"):
        value = getattr(config, name, None)
        if isinstance(value, dict) and value:
            if all(isinstance(v, dict) for v in value.values()):  # Gemma 3: per layer type
                kinds = {v.get("rope_type", v.get("type", "default")) for v in value.values()}
                return ",".join(sorted(k for k in kinds if k != "default")) or "default"
            return str(value.get("rope_type", value.get("type", "default")))
    return "default"


def window(attn: Any, config: Any) -> int | None:
    """A layer's sliding window (None: it attends every key before the query): the attention module's own
    (Qwen2, Qwen3, SmolLM3, Gemma 3 set it per layer type) or, for Mistral and Phi-3, the config's, which every layer
    takes."""
    if getattr(config, "model_type", None) in ("mistral", "phi3"):
        return getattr(config, "sliding_window", None) or None
    return getattr(attn, "sliding_window", None) or None


def layer_norms(layer: Any, gemma: bool = False, olmo: bool = False) -> tuple[Any, Any]:
    """The norms before attention and before the MLP (Gemma's post_attention_layernorm follows attention); OLMo 2's
    after them (it has none before)."""
    if olmo:
        return layer.post_attention_layernorm, layer.post_feedforward_layernorm
    return layer.input_layernorm, layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm


def norm_eps(norm: Any) -> float:
    """An RMSNorm's epsilon (Llama's `variance_epsilon`, Gemma's `eps`; NaN without one)."""
    value = getattr(norm, "variance_epsilon", None)
    value = value if value is not None else getattr(norm, "eps", None)
    return float(value) if isinstance(value, (int, float)) else math.nan
