"""One training smoke per model family grpo claims: a tiny random model of each trains two steps, and resuming
from the first step's checkpoint ends bit-identical. The main suite runs it on the pinned transformers; the
compatibility job (`make test-newest`) on the newest release, which is how the ranges in pyproject.toml are tested."""

from __future__ import annotations

import pytest
import torch
import transformers

from grpo import GRPOTrainer
from support.rewards import length_reward
from support.runs import cfg, chat_dataset, params
from support.tiny import NEMOTRON_H, make_tokenizer

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
# Seed-OSS drops out in training by default (attention and residual dropout 0.1): its runs turn that off, as a GRPO
# run of it should (the training pass otherwise scores other log-probs than the engine sampled)
DROPOUT = ("SeedOss",)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    tokenizer = make_tokenizer()
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    dirs = {}
    for family, settings in FAMILIES.items():
        cls = getattr(transformers, f"{family}ForCausalLM")
        torch.manual_seed(0)
        if "hidden_size_per_layer_input" in settings:  # Gemma 4's per-layer embeddings: of this vocabulary too
            settings = dict(settings, vocab_size_per_layer_input=len(tokenizer))
        model = cls(cls.config_class(vocab_size=len(tokenizer), **settings, **ids))
        dirs[family] = str(tmp_path_factory.mktemp(family.lower()))
        model.save_pretrained(dirs[family])
        tokenizer.save_pretrained(dirs[family])
    return dirs


# transformers' experts gather each expert's tokens (and gpt-oss's biases) by advanced indexing, whose backward on a
# multi-threaded CPU adds in thread order (torch: nondeterministic; gpt-oss's resume differed about one run in 20 here),
# so bit-identical mixture-of-experts runs there need torch's deterministic algorithms (docs/checkpoints.md)
MIXTURES = ("Qwen3Moe", "GptOss", "Qwen3Next", "DeepseekV3", "Glm4Moe", "Ernie4_5_Moe", "Olmoe", "Llama4", "Qwen4Exp")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_trains_and_resumes_exactly(family_dirs, tmp_path, family, restores_determinism):
    def run(name, **kw):
        exact = dict(full_determinism=family in MIXTURES, disable_dropout=family in DROPOUT)
        args = cfg(tmp_path / name, max_steps=2, save_strategy="steps", save_steps=1, logging_steps=1, **exact, **kw)
        return GRPOTrainer(
            model=family_dirs[family], reward_funcs=length_reward, train_dataset=chat_dataset(), args=args
        )

    whole = run("whole")
    before = params(whole.model)
    whole.train()
    after = params(whole.model)
    assert any(not torch.equal(before[n], after[n]) for n in before)  # it learned something
    row = next(r for r in reversed(whole.state.log_history) if "loss" in r)
    assert row["sampling/sampling_logp_difference/max"] < 1e-3  # the engine sampled what the training pass scores
    resumed = run("resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "out" / "checkpoint-1"))
    assert all(torch.equal(after[n], value) for n, value in params(resumed.model).items())


RECURRENT = ("Qwen3_5", "Qwen3Next", "NemotronH", "Lfm2", "FalconH1", "Qwen4Exp")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_trains_without_gradient_checkpointing(family_dirs, tmp_path, family):
    """Without gradient checkpointing the rows of a prompt share its pass (a KV cache) where the model allows: not
    for recurrent layers (Qwen3.5's gated delta rule, NemotronH's Mamba), whose state that cache does not hold (it
    crashed there); either way the engine's sampling log-probs are what the training pass scores."""
    args = cfg(tmp_path, max_steps=1, logging_steps=1, gradient_checkpointing=False, disable_dropout=family in DROPOUT)
    trainer = GRPOTrainer(
        model=family_dirs[family], reward_funcs=length_reward, train_dataset=chat_dataset(), args=args
    )
    # a router's load-balancing loss is computed over whole sequences
    assert trainer.training_pass.share_prefix == (family not in RECURRENT and not trainer.training_pass.router_aux)
    trainer.train()
    row = next(r for r in reversed(trainer.state.log_history) if "loss" in r)
    assert row["sampling/sampling_logp_difference/max"] < 1e-3


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_takes_token_trees_with_the_padded_numbers(family_dirs, family):
    """packing="tree" on each family: log-probs and gradients equal the padded pass's, or (recurrent layers) the
    family is named unsupported and keeps the padded layout."""
    from grpo.learner import tree
    from grpo.learner.forward import token_logps
    from test_shared_prefix_training import batch_and_model

    batch, _ = batch_and_model()
    model = getattr(transformers, f"{family}ForCausalLM").from_pretrained(family_dirs[family])
    reason = tree.unsupported_reason(model)
    if family in RECURRENT:
        assert reason is not None and "recurrent" in reason
        return
    assert reason is None

    def pass_(as_trees):
        model.zero_grad()
        logps, _ = token_logps(model, batch, 0.9, with_entropy=False, as_trees=as_trees)
        (logps * batch.mask).sum().backward()
        # (a parameter only routing reads has no gradient: Ernie 4.5's expert score correction)
        return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (padded, grads), (trees, tree_grads) = pass_(False), pass_(True)
    m = batch.mask.bool()
    torch.testing.assert_close(trees[m], padded[m], rtol=1e-5, atol=1e-6)
    assert tree_grads.keys() == grads.keys()
    for name, grad in grads.items():  # atol scaled as test_shared_prefix_training.assert_same_pass's
        torch.testing.assert_close(tree_grads[name], grad, rtol=1e-5, atol=5e-6 * max(1.0, float(grad.abs().max())))


def test_a_per_layer_mlp_width_costs_each_layer_its_own():
    """Gemma 3n's config gives one intermediate_size per layer (a list): the tree's cost model (`packing="auto"`,
    the CPU's default, and "tree") read it as one number and failed with a TypeError before the first step."""
    import types

    from grpo.learner import tree

    def cost(widths):
        config = transformers.Gemma3nTextConfig(
            **dict(SMALL, intermediate_size=widths, head_dim=4, layer_types=["sliding_attention", "full_attention"])
        )
        return tree.pair_cost(types.SimpleNamespace(config=config))

    narrow, mixed, wide = cost([32, 32]), cost([32, 64]), cost([64, 64])
    assert narrow > mixed > wide > 0  # a wider MLP makes a token cost more against a pair
    d, pair = 16, 2 * (2 * 4 * 4)  # two layers of 2 * heads * head_dim multiply-adds per (query, key) pair
    token = sum(2 * d * 4 * 4 + 2 * d * 2 * 4 + 3 * d * inner for inner in (32, 64))  # q and o, k and v, the MLP
    assert mixed == pytest.approx(pair / token)


@pytest.mark.parametrize("chunk", [8, 4096])
def test_chunked_attention_takes_trees_only_within_its_first_chunk(chunk):
    """Llama 4's chunked layers attend within fixed chunks of positions, which a tree's mask does not hold: rows
    longer than a chunk keep the padded layout (as past a sliding window; trees were 0.055 off there), shorter ones
    run as trees; either way the padded numbers."""
    from collections import Counter

    from grpo.learner.forward import token_logps
    from test_shared_prefix_training import batch_and_model

    batch, _ = batch_and_model()  # rows of about 20 to 40 tokens
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        vocab_size=len(make_tokenizer()),
        **dict(SMALL, head_dim=4, intermediate_size_mlp=32, num_local_experts=4, num_experts_per_tok=1),
        interleave_moe_layer_step=2,
        attention_chunk_size=chunk,
        no_rope_layers=[1, 0],
    )
    model = transformers.Llama4ForCausalLM(config)
    laid_out: Counter[str] = Counter()
    padded, _ = token_logps(model, batch, 0.9, with_entropy=False)
    trees, _ = token_logps(model, batch, 0.9, with_entropy=False, as_trees=True, laid_out=laid_out)
    assert laid_out == Counter({"padded" if chunk == 8 else "trees": 1})
    m = batch.mask.bool()
    torch.testing.assert_close(trees[m], padded[m], rtol=1e-5, atol=1e-6)
