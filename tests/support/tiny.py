"""Tiny models and a tokenizer built locally (no hub): character-level vocabulary, ChatML chat template whose
end-of-turn token (<|im_end|>) differs from EOS (<eos>), and a 2-layer Llama with random weights."""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHARS = list(string.ascii_letters + string.digits + string.punctuation + " \n")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """The character-level ChatML tokenizer; with `vocab_size`, padded with filler tokens (<t0>, <t1>, ...) to
    that many entries (a real model's head width: bench/random_model.py)."""
    names = SPECIALS + CHARS
    names += [f"<t{i}>" for i in range((vocab_size or 0) - len(names))]
    vocab = {tok: i for i, tok in enumerate(names)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = CHATML
    return tok


# a tiny NemotronH (Mamba and attention layers: recurrent state, so the plain engine samples it)
NEMOTRON_H = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    layers_block_type=["mamba", "attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=4,
    mamba_num_heads=4,
    mamba_head_dim=8,
    ssm_state_size=8,
    n_groups=1,
    mamba_chunk_size=8,
)


def make_model(
    tokenizer: PreTrainedTokenizerFast, seed: int = 0, hidden: int = 32, layers: int = 2, context: int = 512
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def make_qwen3(tokenizer: PreTrainedTokenizerFast, seed: int = 0, hidden: int = 64) -> Qwen3ForCausalLM:
    """A 2-layer Qwen3 of the tiny tokenizer: per-head query/key RMSNorms (their weights drawn far from 1, so that
    a norm left out or misplaced shows), grouped queries, a head size of its own, a tied head."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.3, 2.5)
            layer.self_attn.k_norm.weight.uniform_(0.3, 2.5)
    return model


def make_gemma3(tokenizer: PreTrainedTokenizerFast, seed: int = 0, hidden: int = 64, window: int = 4, **config):
    """A 3-layer Gemma 3 text model of the tiny tokenizer: sliding layers (a window of `window` tokens, so that
    short rows already cross it) beside a full one, each rotated at its own base, per-head query/key norms and
    sandwich norms (their weights drawn away from 0: Gemma's norms multiply by 1 + weight), scaled embeddings, the
    tanh GELU, a tied head."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        attn_implementation="eager",
    )
    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**settings, **config}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 1.0)
    return model


def with_lora(model, seed: int = 1, **config):
    """`model` with LoRA adapters (r=16, alpha 32, dropout 0.1 (off in eval mode); every linear unless `config`
    says otherwise), lora_B drawn at random so that the adapters change the output (PEFT starts it at zero)."""
    from peft import LoraConfig, get_peft_model

    config = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.1, "target_modules": "all-linear", **config}
    model = get_peft_model(model, LoraConfig(**config))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
            elif "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def save_tiny_moe(path, seed: int = 0) -> str:
    """A 2-layer Mixtral (4 experts, 2 per token) with random weights and the tiny tokenizer, saved to `path`."""
    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    MixtralForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def save_tiny(path, seed: int = 0) -> str:
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
