"""The windows a model's attention keeps (a sliding window, chunks of positions, GPT-Neo's local band, ...), as
transformers' configs spell them, and the widest token tree that cannot cross one (`grpo.learner.tree` lays trees
out no wider; `tree.fits_window` asks whether a batch's rows fit)."""

from __future__ import annotations

from typing import Any

from grpo.learner import tree_attention
from grpo.models.modeling import layer_configs, unwrap

# The config settings that bound how far back a token attends, as transformers' configs spell them (read from a
# model's text config and each layer's, `layer_configs`; a list gives one per layer):
WINDOWS = (
    "sliding_window",  # Mistral, Gemma 2 to 4, gpt-oss, Cohere2, Olmo 3, ...: the layers `layer_types` names sliding
    "attention_chunk_size",  # Llama 4's chunked layers: within fixed chunks of positions
    "sliding_window_size",  # Inkling's sliding layers
    "attention_window_size",  # RecurrentGemma's local attention
    "window_size",  # GPT-Neo's local layers (`attention_layers`): a band of columns inside the attention
    "attention_window",  # Longformer, LED
    "local_window",
    "local_attention",  # ModernBERT's decoder (its sliding window is half of it)
    "keep_window_size",  # Doge: past that many keys, only the top ones are attended
    "local_attn_chunk_length",  # Reformer's local chunks
)
# Of those, the ones transformers' own models apply through the attention mask they build from the 2D mask
# (`masking_utils`' sliding and chunked masks), which a tree's prepared mask replaces: there a tree is exact where
# each of its rows fits, however wide the tree. Any other, and any window of a model whose code is not transformers'
# own, may be applied over the columns of the input whatever mask the model is handed (GPT-Neo builds its band from
# the distance between columns), and a tree's columns are not positions: no tree is wider than it (`window_cap`).
MASK_WINDOWS = ("sliding_window", "attention_chunk_size")


def windows(model: Any) -> dict[str, int]:
    """Each window setting (`WINDOWS`) the model's config or one of its layers' configs sets, at its smallest: a
    positive number, or the smallest of a list of them. GPT-Neo's `window_size` counts where a layer is "local"."""
    config = tree_attention.text_config(model)  # a VLM's: its language model's
    found: dict[str, int] = {}
    layers = {id(layer): layer for layer in [config, *layer_configs(config)]}  # (configs are not hashable)
    for layer in layers.values():
        for name in WINDOWS:
            value = getattr(layer, name, None)
            values = value if isinstance(value, (list, tuple)) else [value]
            sizes = [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0]
            if name == "window_size" and "local" not in (getattr(layer, "attention_layers", None) or ["local"]):
                sizes = []  # GPT-Neo without local layers
            if sizes:
                found[name] = min([found.get(name, min(sizes)), *sizes])
    return found


def window_cap(model: Any) -> int | None:
    """The widest a tree may be for this model (None: `MAX_WIDTH` alone bounds it): the smallest window that the
    model may apply over the columns of its input (`MASK_WINDOWS`: any other spelling; any at all where the model's
    code is not transformers' own). Within a tree that narrow no two columns are a window apart, as in the padded
    rows of a piece whose every row fits it (`fits_window`), so the window masks nothing in either."""
    # the model's own class (FSDP2 makes a subclass of it in a torch module); remote code's is transformers_modules'
    own = next((c for c in type(unwrap(model)).__mro__ if not c.__module__.startswith("torch.")), object)
    native = own.__module__.startswith("transformers.")
    sizes = [size for name, size in windows(model).items() if not (native and name in MASK_WINDOWS)]
    return min(sizes) if sizes else None


def window_cap_reason(model: Any) -> str | None:
    """Why trees are no wider than `window_cap` (None where they may be as wide as `MAX_WIDTH`)."""
    cap = window_cap(model)
    if cap is None:
        return None
    names = ", ".join(f"{name}={size}" for name, size in windows(model).items() if size == cap)
    return (
        f"the model attends a window of {cap} tokens ({names}), which it may apply over the columns of its input "
        "(a tree's columns are not positions)"
    )
