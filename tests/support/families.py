"""The model families grpo claims, as tiny configs (`FAMILIES`: each family's transformers config arguments, 2 layers
16 wide unless the family needs more): what tests/integration/test_model_families.py trains, one smoke each."""

from __future__ import annotations

from support.tiny import NEMOTRON_H

SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
QWEN_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)  # Qwen3-MoE's and Qwen3-Next's
# Qwen3.5's and Qwen3-Next's gated delta-rule linear attention beside full attention
GATED_DELTA = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_key_head_dim=4,
    linear_value_head_dim=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
# DeepSeek-V3's and GLM-4.5's: a dense first layer, then routed experts with grouped top-k routing
DEEPSEEK_EXPERTS = dict(
    moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1
)
FAMILIES = {
    "Llama": dict(SMALL),
    "Qwen2": dict(SMALL),
    "Qwen3": dict(SMALL, head_dim=4),
    "Mistral": dict(SMALL, head_dim=4),
    "Gemma2": dict(SMALL, head_dim=4),
    "Gemma3": dict(SMALL, head_dim=4),  # Gemma3ForCausalLM: the text model
    # Gemma4ForCausalLM: per-layer inputs, global layers with wider heads, one key-value head and keys that are
    # their values (per-layer configs, as Gemma 4's larger models), sliding ones
    "Gemma4": dict(
        SMALL,
        num_hidden_layers=4,
        head_dim=4,
        global_head_dim=8,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        hidden_size_per_layer_input=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,  # as Gemma 4 E2B/E4B: the last layers attend the keys and values of earlier ones
    ),
    "SmolLM3": dict(SMALL, no_rope_layers=[1, 0]),  # a layer without rotary embeddings
    "Olmo3": dict(SMALL),
    # mixtures of experts: Qwen3's, and gpt-oss's (attention sinks, sliding and full layers, experts with biases)
    "Qwen3Moe": dict(SMALL, head_dim=4, **QWEN_EXPERTS),
    "GptOss": dict(
        SMALL,
        head_dim=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"],
    ),
    # Qwen3_5ForCausalLM (Qwen3.5's text model): gated delta-rule linear attention (recurrent state) between gated
    # full-attention layers with partial rotary embeddings: the plain engine, padded rows
    "Qwen3_5": dict(SMALL, head_dim=4, **GATED_DELTA),
    "Qwen3Next": dict(SMALL, head_dim=4, **QWEN_EXPERTS, **GATED_DELTA),  # Qwen3.5's layers with expert blocks
    "NemotronH": NEMOTRON_H,  # Mamba and attention layers: the plain engine (recurrent state)
    "Phi3": dict(SMALL, partial_rotary_factor=0.5),  # Phi-3 and Phi-4 mini: fused qkv and gate-up, partial rotary
    # DeepSeek-V3: multi-head latent attention (low-rank queries and keys/values, values narrower than the queries'
    # heads), its experts with a shared one
    "DeepseekV3": dict(
        SMALL,
        num_key_value_heads=4,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=6,
        n_shared_experts=1,
        **DEEPSEEK_EXPERTS,
    ),
    # GLM-4.5: DeepSeek-V3's routing on grouped-query attention with partial rotary
    "Glm4Moe": dict(SMALL, head_dim=4, partial_rotary_factor=0.5, **DEEPSEEK_EXPERTS),
    "Ernie4_5_Moe": dict(SMALL, moe_intermediate_size=8, moe_num_experts=4, moe_k=2, moe_layer_start_index=1),
    "Olmoe": dict(SMALL, num_experts=4, num_experts_per_tok=2),
    # Llama 4's text model: experts every other layer beside a dense one, a layer without rotary embeddings, chunked
    # attention; its config's router loss coefficient meets a forward that computes none (trained without, warned)
    "Llama4": dict(
        SMALL,
        head_dim=4,
        intermediate_size_mlp=32,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        no_rope_layers=[1, 0],
    ),
    # Granite: scaled embeddings, residuals and attention, logits divided after the head (the full head, not tiled)
    "Granite": dict(
        SMALL, embedding_multiplier=2.0, logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.3
    ),
    # Cohere2 (Command R7B, Command A): parallel attention and MLP, logits scaled after the head, sliding layers
    "Cohere2": dict(
        SMALL, head_dim=4, logit_scale=0.5, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    ),
    "Exaone4": dict(SMALL, head_dim=4, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "SeedOss": dict(SMALL, head_dim=4),  # attention and residual dropout by default: trained with disable_dropout
    "Apertus": dict(SMALL),  # xIELU activations, query-key norms
    # Qwen4-Exp: gated delta-rule layers beside sparse attention through a key indexer, experts, hyper-connections
    # and n-gram embeddings
    "Qwen4Exp": dict(
        SMALL,
        head_dim=4,
        **QWEN_EXPERTS,
        **dict(GATED_DELTA, layer_types=["linear_attention", "indexed_attention"]),
        shared_expert_intermediate_size=8,
        hc_lowrank=4,
        ple_embed_dim=8,
        ngram_vocab_size_base=256,
        heads_per_ngram=2,
        split_ngram_parts=4,
        make_ngram_vocab_size_divisible_by=8,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=4,
        indexer_budget=8,
        indexer_compress_ratio=2,
    ),
    # hybrids with recurrent state: LFM2's short convolutions, Falcon-H1's Mamba-2 heads beside attention
    "Lfm2": dict(SMALL, layer_types=["conv", "full_attention"], block_dim=16, block_ff_dim=32),
    "FalconH1": dict(
        SMALL,
        head_dim=4,
        mamba_d_ssm=16,
        mamba_n_heads=4,
        mamba_d_head=4,
        mamba_n_groups=1,
        mamba_d_state=4,
        mamba_chunk_size=8,
    ),
}
