"""One training smoke per model family grpo claims: a tiny random model of each trains two steps, and resuming
from the first step's checkpoint ends bit-identical. The main suite runs it on the pinned transformers; the
compatibility job (`make test-newest`) on the newest release, which is how the ranges in pyproject.toml are tested."""

from __future__ import annotations

import pytest
import torch
import transformers

from grpo import GRPOTrainer
from support.families import FAMILIES, SMALL
from support.rewards import length_reward
from support.runs import cfg, chat_dataset, params
from support.tiny import make_tokenizer

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
    from grpo.learner.layouts import PassSettings
    from support.layouts import batch_and_model

    batch, _ = batch_and_model()
    model = getattr(transformers, f"{family}ForCausalLM").from_pretrained(family_dirs[family])
    reason = tree.unsupported_reason(model)
    if family in RECURRENT:
        assert reason is not None and "recurrent" in reason
        return
    assert reason is None

    def pass_(as_trees):
        model.zero_grad()
        logps = token_logps(
            model, batch, PassSettings(0.9, with_entropy=False, layouts=("trees" if as_trees else "padded",))
        ).logps
        (logps * batch.mask).sum().backward()
        # (a parameter only routing reads has no gradient: Ernie 4.5's expert score correction)
        return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (padded, grads), (trees, tree_grads) = pass_(False), pass_(True)
    m = batch.mask.bool()
    torch.testing.assert_close(trees[m], padded[m], rtol=1e-5, atol=1e-6)
    assert tree_grads.keys() == grads.keys()
    for name, grad in grads.items():  # atol scaled as support.layouts.assert_same_pass's
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

    from grpo.learner.forward import token_logps
    from grpo.learner.layouts import PassSettings
    from support.layouts import batch_and_model

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
    padded = token_logps(model, batch, PassSettings(0.9, with_entropy=False)).logps
    scored = token_logps(model, batch, PassSettings(0.9, with_entropy=False, layouts=("trees",)))
    trees = scored.logps
    assert scored.layouts == ("padded" if chunk == 8 else "trees",)
    m = batch.mask.bool()
    torch.testing.assert_close(trees[m], padded[m], rtol=1e-5, atol=1e-6)
