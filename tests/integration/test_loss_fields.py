"""The loss and model fields of TRL 1.16 wired in the trainer: the adaptive entropy controller
(`use_adaptive_entropy`, `entropy_coef_min/max/delta`, `entropy_target`), TR-DPO's moving reference
(`sync_ref_model`, `ref_model_mixup_alpha`, `ref_model_sync_steps`), `cast_lm_head_to_fp32`,
`router_aux_loss_coef` and `pad_to_multiple_of`, against hand computations. (`use_bias_correction_kl`'s math is in
test_losses.py.)"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralForCausalLM

from grpo import GRPOConfig, GRPOTrainer
from grpo.algo.entropy_control import EntropyController
from grpo.algo.loss_terms import LossTerms, router_aux_coef
from grpo.algo.losses import policy_loss
from grpo.base.records import Rollout
from grpo.data.prompts import tokenize_prompts
from grpo.learner.batch import collate
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings
from grpo.models.fp32_head import Float32Head, cast_lm_head_to_fp32
from support.rewards import length_reward
from support.runs import cfg, chat_dataset
from support.scripted import ScriptedEngine
from support.tiny import make_model, make_tokenizer, save_tiny_moe

# ---- the entropy controller, step by step -------------------------------------------------------------------


def test_adaptive_controller_step_by_step():
    c = EntropyController(coef=0.1, adaptive=True, target=0.5, delta=0.05, coef_min=0.02, coef_max=0.2)
    assert c.last_world_entropy == math.inf and c.applied == 0.0  # no measurement yet: no bonus in step 1
    # (entropy sum, tokens) of each step -> world entropy -> coefficient after the step, and what the next applies
    steps = [
        ((0.8, 2), 0.4, 0.15, 0.15),  # 0.4 <= 0.5: +0.05; the next step applies it (0.4 <= target)
        ((1.2, 2), 0.6, 0.10, 0.0),  # 0.6 > 0.5: -0.05; the next step applies nothing (0.6 > target)
        ((0.5, 1), 0.5, 0.15, 0.15),  # equal to the target counts as "at or below"
        ((0.1, 1), 0.1, 0.2, 0.2),
        ((0.1, 1), 0.1, 0.2, 0.2),  # capped at coef_max
        ((9.0, 3), 3.0, 0.15, 0.0),
        ((9.0, 3), 3.0, 0.1, 0.0),
        ((9.0, 3), 3.0, 0.05, 0.0),
        ((9.0, 3), 3.0, 0.02, 0.0),  # floored at coef_min
        ((9.0, 3), 3.0, 0.02, 0.0),
    ]
    for (total, tokens), world, coef, applied in steps:
        c.end_step(total, tokens)
        assert c.last_world_entropy == pytest.approx(world)
        assert c.coef == pytest.approx(coef)
        assert c.applied == pytest.approx(applied)


def test_static_controller_and_state():
    args = GRPOConfig(output_dir="unused", per_device_train_batch_size=4, num_generations=2)
    assert EntropyController.of(args) is None  # entropy_coef 0, not adaptive: no bonus at all
    static = EntropyController.of(GRPOConfig(**{**_small(), "entropy_coef": 0.3}))
    static.end_step(100.0, 1.0)
    assert static.applied == 0.3 and static.coef == 0.3  # a fixed coefficient never moves
    adaptive = EntropyController.of(GRPOConfig(**{**_small(), "use_adaptive_entropy": True}))
    assert adaptive.coef == 0.0 and adaptive.applied == 0.0  # adaptive from 0: on, applies 0 until it grows
    adaptive.end_step(0.1, 1.0)  # 0.1 <= the default target 0.2
    assert adaptive.coef == pytest.approx(0.005) and adaptive.applied == pytest.approx(0.005)
    # the state is JSON (the initial +inf as null) and comes back as it was
    fresh = EntropyController(coef=0.7, adaptive=True)
    assert json.loads(json.dumps(fresh.state_dict())) == {"entropy_coef": 0.7, "last_world_entropy": None}
    restored = EntropyController(coef=0.0, adaptive=True)
    restored.load_state_dict(json.loads(json.dumps(adaptive.state_dict())))
    assert (restored.coef, restored.last_world_entropy) == (adaptive.coef, adaptive.last_world_entropy)
    restored.load_state_dict(fresh.state_dict())
    assert restored.last_world_entropy == math.inf
    with pytest.raises(ValueError, match="not two numbers"):
        restored.load_state_dict({"entropy_coef": "high", "last_world_entropy": None})


def _small(**kw):
    return dict(output_dir="unused", per_device_train_batch_size=4, num_generations=2, **kw)


def test_loss_terms_by_hand():
    """GA = 2; one micro-batch: entropies (B=1, T=3) [1, 2, 4] with the last token masked out."""
    args = GRPOConfig(**_small(entropy_coef=0.5, gradient_accumulation_steps=2, use_adaptive_entropy=True))
    terms = LossTerms(args, aux_coef=0.25)
    terms.entropy.last_world_entropy = 0.1  # below the target: the step applies its coefficient 0.5
    ent = torch.tensor([[1.0, 2.0, 4.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = terms.add(torch.tensor(3.0), ent, mask, aux_loss=torch.tensor(2.0))
    # 3 - 0.5 * mean(1, 2) / GA + 0.25 * 2 / GA = 3 - 0.375 + 0.25
    assert loss.item() == pytest.approx(2.875)
    assert stats["policy_loss"].local() == pytest.approx(6.0)  # times GA: the mean of GA micro-batches is the step's
    assert stats["aux_loss"].local() == pytest.approx(2.0)
    (grad,) = torch.autograd.grad(loss, ent)  # the bonus's gradient: -0.5 / GA / 2 tokens on the active ones
    assert grad.tolist() == [[-0.125, -0.125, 0.0]]
    terms.add(torch.tensor(0.0), torch.tensor([[3.0, 3.0, 3.0]]), torch.ones(1, 3), None)
    one_process = SimpleNamespace(device=torch.device("cpu"), reduce=lambda t, reduction: t)
    # the step's entropy: (1 + 2 + 9) / 5 = 2.4 > 0.2: the coefficient goes down by 0.005
    assert terms.end_step(one_process) == {"entropy_coef": pytest.approx(0.495)}
    assert terms.entropy.last_world_entropy == pytest.approx(2.4) and terms.window is None


def _entropy_run(tmp_path, name, **kw):
    tok = make_tokenizer()
    trainer = GRPOTrainer(
        model=make_model(tok),
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path / name, use_adaptive_entropy=True, entropy_coef=0.1, entropy_coef_delta=0.05, **kw),
        processing_class=tok,
    )
    trainer.engine = ScriptedEngine(tok)
    trainer.train()
    return trainer


def test_adaptive_entropy_in_training(tmp_path):
    # the tiny model's entropy (~4.6 nats) is below a target of 100: the coefficient grows by delta each step
    # (logged after the step: the next step's), and step k applies the coefficient logged at step k - 1, except
    # step 1, which applies nothing (no entropy measured yet)
    trainer = _entropy_run(tmp_path, "up", entropy_target=100.0, max_steps=3)
    rows = trainer.state.log_history
    assert [r["entropy_coef"] for r in rows] == pytest.approx([0.15, 0.2, 0.25])
    applied = [0.0, 0.15, 0.2]
    for row, coef in zip(rows, applied):  # GA = 1: loss = policy_loss - coef * mean entropy
        assert row["loss"] == pytest.approx(row["policy_loss"] - coef * row["entropy"], abs=1e-6)
    assert trainer.parts.loss_terms.entropy.last_world_entropy == pytest.approx(rows[-1]["entropy"], rel=1e-6)
    # above the target (0): it shrinks to entropy_coef_min and no step applies a bonus
    rows = _entropy_run(tmp_path, "down", entropy_target=0.0, max_steps=3).state.log_history
    assert [r["entropy_coef"] for r in rows] == pytest.approx([0.05, 0.0, 0.0])
    assert all(r["loss"] == pytest.approx(r["policy_loss"], abs=1e-7) for r in rows)


def test_adaptive_entropy_state_is_checkpointed_and_resumed(tmp_path):
    whole = _entropy_run(tmp_path, "whole", entropy_target=100.0, max_steps=2, save_strategy="steps", save_steps=1)
    with open(tmp_path / "whole" / "out" / "checkpoint-1" / "trainer_state.json") as f:
        saved = json.load(f)["entropy_control"]
    assert saved["entropy_coef"] == pytest.approx(0.15)
    assert saved["last_world_entropy"] == pytest.approx(whole.state.log_history[0]["entropy"], rel=1e-6)
    tok = make_tokenizer()
    resumed = GRPOTrainer(
        model=make_model(tok),
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(
            tmp_path / "resumed",
            use_adaptive_entropy=True,
            entropy_coef=0.1,
            entropy_coef_delta=0.05,
            entropy_target=100.0,
            max_steps=2,
        ),
        processing_class=tok,
    )
    resumed.engine = ScriptedEngine(tok)
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "out" / "checkpoint-1"))
    # without the restored state step 2 would apply 0 (inf) and log 0.15
    last, want = resumed.state.log_history[-1], whole.state.log_history[-1]
    assert last["step"] == 2 and last["entropy_coef"] == pytest.approx(0.2)
    assert last["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert last["policy_loss"] - last["loss"] == pytest.approx(0.15 * last["entropy"], rel=1e-4)


# ---- sync_ref_model (TR-DPO) ---------------------------------------------------------------------------------


def _sync_run(tmp_path, name, max_steps=2, resume=None, **kw):
    tok = make_tokenizer()
    trainer = GRPOTrainer(
        model=make_model(tok),
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path / name, beta=0.1, sync_ref_model=True, max_steps=max_steps, **kw),
        processing_class=tok,
    )
    trainer.engine = ScriptedEngine(tok)
    snapshots = [_params(trainer.unwrapped_model)]
    step = trainer.optimizer.step

    def step_and_snapshot(*args, **kwargs):
        out = step(*args, **kwargs)
        snapshots.append(_params(trainer.unwrapped_model))
        return out

    trainer.optimizer.step = step_and_snapshot
    trainer.train(resume_from_checkpoint=resume)
    return trainer, snapshots


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("sync_steps", [1, 2])
def test_reference_is_mixed_with_the_policy(tmp_path, sync_steps):
    alpha = 0.6
    trainer, (theta0, theta1, theta2) = _sync_run(
        tmp_path, f"every{sync_steps}", ref_model_mixup_alpha=alpha, ref_model_sync_steps=sync_steps
    )
    ref = _params(trainer.ref_model)
    assert set(ref) == set(theta0)
    for name in theta0:
        if sync_steps == 1:  # ref1 = a theta1 + (1 - a) theta0; ref2 = a theta2 + (1 - a) ref1
            ref1 = alpha * theta1[name] + (1 - alpha) * theta0[name]
            expected = alpha * theta2[name] + (1 - alpha) * ref1
        else:  # only after step 2
            expected = alpha * theta2[name] + (1 - alpha) * theta0[name]
        torch.testing.assert_close(ref[name], expected, rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(theta2[n], theta0[n]) for n in theta0)  # the policy did move


def test_mixed_reference_is_checkpointed_and_resumed(tmp_path):
    whole, _ = _sync_run(tmp_path, "whole", ref_model_sync_steps=1, save_strategy="steps", save_steps=1)
    checkpoint = tmp_path / "whole" / "out" / "checkpoint-1"
    assert os.path.isfile(checkpoint / "reference" / "model.safetensors")
    resumed, _ = _sync_run(tmp_path, "resumed", ref_model_sync_steps=1, resume=str(checkpoint))
    for name, value in _params(whole.ref_model).items():
        torch.testing.assert_close(_params(resumed.ref_model)[name], value, rtol=1e-5, atol=1e-6)


def test_sync_ref_model_refuses_without_a_reference_model(tmp_path, tiny_model_dir):
    from peft import LoraConfig

    with pytest.raises(NotImplementedError, match="sync_ref_model=True is not supported with a PEFT"):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path, beta=0.1, sync_ref_model=True),
            peft_config=LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"),
        )
    with pytest.raises(ValueError, match="sync_ref_model needs a reference model"):
        cfg(tmp_path, sync_ref_model=True)  # beta = 0 loads no reference


# ---- cast_lm_head_to_fp32 ----------------------------------------------------------------------------------------


def _rollout(tok):
    """Two prompts of different lengths, three completions each, of lengths 1 to 7 in increasing order (so the
    training pass, which sorts rows by length, keeps the rows in place)."""
    gen = torch.Generator().manual_seed(0)
    prompts = tokenize_prompts([[{"role": "user", "content": t}] for t in ("hi", "what is two plus two?")], tok)
    rows = [p for p in prompts for _ in range(3)]
    completions = [torch.randint(10, len(tok), (n,), generator=gen).tolist() for n in (1, 2, 3, 4, 6, 7)]
    return Rollout(rows, completions, [[0.0] * len(c) for c in completions], [False] * len(rows))


def _hand_logps(model, batch, temperature):
    """log_softmax(h W^T / T) of the completion tokens, projected by hand in float32 from the hidden states the
    model's head receives."""
    seen = []
    handle = model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    try:
        token_logps(
            model, batch, PassSettings(temperature, with_entropy=False)
        )  # the plain pass: the head sees every position
    finally:
        handle.remove()
    hidden = seen[-1].float()  # (B, C + 1, H): position t predicts completion token t
    with torch.autocast("cpu", enabled=False):
        logits = hidden[:, :-1] @ model.lm_head.weight.float().T / temperature
    return torch.log_softmax(logits, -1).gather(-1, batch.completion_ids[:, : logits.shape[1], None])[..., 0]


@pytest.mark.parametrize("chunked_head", [False, True])
def test_fp32_head_projects_in_float32_under_bf16_autocast(chunked_head):
    tok = make_tokenizer()
    batch = collate(_rollout(tok), torch.zeros(6), tok.pad_token_id, mask_truncated=False)
    mask = batch.mask.bool()
    errors = {}
    for cast in (False, True):
        model = make_model(tok, seed=1).to(torch.bfloat16)
        if cast:
            cast_lm_head_to_fp32(model)
            assert isinstance(model.lm_head, Float32Head) and model.lm_head.weight.dtype == torch.float32
            assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16  # only the head
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logps = token_logps(model, batch, PassSettings(0.7, with_entropy=False, chunked_head=chunked_head)).logps
            hand = _hand_logps(model, batch, 0.7)
        assert logps.dtype == torch.float32
        errors[cast] = (logps[mask] - hand[mask]).abs().max().item()
    assert errors[True] < 2e-6  # the float32 projection of the same hidden states
    assert errors[False] > 1e-4  # a bfloat16 head is visibly different (~5e-4): the check is sensitive


def test_fp32_head_in_the_trainer(tmp_path, tiny_model_dir):
    from peft import LoraConfig

    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path, bf16=True, beta=0.1, cast_lm_head_to_fp32=True, model_init_kwargs={"dtype": "bfloat16"}),
    )
    for model in (trainer.unwrapped_model, trainer.ref_model):
        assert isinstance(model.lm_head, Float32Head) and model.lm_head.weight.dtype == torch.float32
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert trainer.training_pass.chunked_head  # the tiled head computes in float32 (tested above)
    before = trainer.unwrapped_model.lm_head.weight.detach().clone()
    trainer.train()
    after = trainer.unwrapped_model.lm_head.weight
    assert after.dtype == torch.float32 and not torch.equal(before, after)
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32=True cannot be used with a PEFT adapter"):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path, cast_lm_head_to_fp32=True),
            peft_config=LoraConfig(r=4, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM"),
        )


def test_fp32_head_with_tied_embeddings():
    tok = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    cast_lm_head_to_fp32(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.dtype == torch.float32
    ids = torch.tensor([[5, 6, 7]])
    assert model.model.embed_tokens(ids).dtype == torch.bfloat16  # the embedding's output keeps the model's dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(ids).logits.dtype == torch.float32


# ---- router_aux_loss_coef ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    return save_tiny_moe(tmp_path_factory.mktemp("moe") / "tiny-mixtral")


def test_router_aux_coefficient(moe_model_dir, tiny_model_dir):
    moe = MixtralForCausalLM.from_pretrained(moe_model_dir)
    llama = LlamaForCausalLM.from_pretrained(tiny_model_dir)

    def args(coef):
        return SimpleNamespace(router_aux_loss_coef=coef)

    assert router_aux_coef(moe, args(None)) == 0.001  # the config's own coefficient
    assert router_aux_coef(moe, args(0.5)) == 0.5
    assert router_aux_coef(moe, args(0.0)) == 0.0  # off
    assert router_aux_coef(llama, args(None)) == 0.0 and router_aux_coef(llama, args(0.0)) == 0.0
    with pytest.raises(ValueError, match="router_aux_loss_coef is 0.5, but LlamaForCausalLM is not a mixture"):
        router_aux_coef(llama, args(0.5))


def test_a_model_that_computes_no_router_loss_is_told_at_start_up(moe_model_dir):
    """Llama 4's config (like Mixtral's) declares router logits and a coefficient (0.001), but its forward takes no
    output_router_logits and returns no aux_loss; TRL asks for it anyway and fails at the first training pass. Here
    the config's coefficient is not used (warned), and one set in GRPOConfig stops the run at start-up, named."""
    from peft import LoraConfig, get_peft_model
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    llama4 = Llama4ForCausalLM(
        Llama4TextConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, intermediate_size_mlp=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_local_experts=2, interleave_moe_layer_step=2,
        )
    )  # fmt: skip
    assert llama4.config.router_aux_loss_coef == 0.001
    with pytest.warns(UserWarning, match=r"Llama4ForCausalLM computes no router load-balancing loss .* \(0.001\)"):
        assert router_aux_coef(llama4, SimpleNamespace(router_aux_loss_coef=None)) == 0.0
    with pytest.raises(ValueError, match="is 0.5, but Llama4ForCausalLM's forward computes no load-balancing loss"):
        router_aux_coef(llama4, SimpleNamespace(router_aux_loss_coef=0.5))
    assert router_aux_coef(llama4, SimpleNamespace(router_aux_loss_coef=0.0)) == 0.0
    # under LoRA the base model's forward decides: Mixtral's computes the loss
    adapted = get_peft_model(MixtralForCausalLM.from_pretrained(moe_model_dir), LoraConfig(target_modules=["q_proj"]))
    assert router_aux_coef(adapted, SimpleNamespace(router_aux_loss_coef=None)) == 0.001


def _moe_step(tmp_path, moe_model_dir, coef, seen=None):
    trainer = GRPOTrainer(
        model=moe_model_dir,
        reward_funcs=length_reward,
        train_dataset=chat_dataset(),
        args=cfg(tmp_path / f"coef{coef}", router_aux_loss_coef=coef, gradient_accumulation_steps=2),
    )
    if seen is not None:  # record what the training forward is asked for, and the model's own aux loss
        model = trainer.unwrapped_model
        original = model.forward

        def forward(*args, **kwargs):
            out = original(*args, **kwargs)
            if torch.is_grad_enabled():
                seen.append((kwargs.get("output_router_logits"), out.aux_loss))
            return out

        model.forward = forward
    trainer.train()
    return trainer.state.log_history[-1]


def test_router_aux_loss_is_added(tmp_path, moe_model_dir):
    seen, seen_without = [], []
    with_aux = _moe_step(tmp_path, moe_model_dir, 0.5, seen)
    without = _moe_step(tmp_path, moe_model_dir, 0.0, seen_without)
    # the training forward asked for router logits; the logged aux_loss is the mean of the model's own; without
    # the router loss the forward is called as before (no output_router_logits: the config's False)
    assert [flag for flag, _ in seen] == [True, True] and [flag for flag, _ in seen_without] == [None, None]
    assert with_aux["aux_loss"] == pytest.approx(sum(a.item() for _, a in seen) / 2, rel=1e-6)
    assert "aux_loss" not in without
    # the same completions (same seed, first step): loss + 0.5 * aux_loss (the mean over the 2 micro-batches of
    # 0.5 * aux / GA, summed over them)
    assert with_aux["loss"] - without["loss"] == pytest.approx(0.5 * with_aux["aux_loss"], rel=1e-5)


# ---- pad_to_multiple_of ------------------------------------------------------------------------------------------


def test_pad_to_multiple_of_resolves():
    assert GRPOConfig(**_small()).pad_to_multiple_of is None  # "auto": none off Neuron
    assert GRPOConfig(**_small(pad_to_multiple_of="none")).pad_to_multiple_of is None
    assert GRPOConfig(**_small(pad_to_multiple_of="16")).pad_to_multiple_of == 16


@pytest.mark.parametrize("share_prefix", [False, True])
def test_padding_to_a_multiple_changes_shapes_not_numbers(share_prefix):
    tok = make_tokenizer()
    model = make_model(tok, seed=2)
    rollout = _rollout(tok)
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    advantages = torch.tensor([1.0, -0.5, -0.5, 0.3, 0.2, -0.5])
    plain = collate(rollout, advantages, tok.pad_token_id, False, group=group)
    padded = collate(rollout, advantages, tok.pad_token_id, False, group=group, pad_to_multiple_of=16)
    assert plain.prompt_ids.shape[1] % 16 and plain.completion_ids.shape[1] % 16
    assert padded.prompt_ids.shape[1] == padded.prompt_mask.shape[1] == math.ceil(plain.prompt_ids.shape[1] / 16) * 16
    for name in ("completion_ids", "completion_attention", "mask", "sampling_logps"):
        assert getattr(padded, name).shape == (6, 16), name
    assert padded.prompt_ids[:, -plain.prompt_ids.shape[1] :].equal(plain.prompt_ids)  # left padding, prompts
    assert padded.completion_ids[:, : plain.completion_ids.shape[1]].equal(plain.completion_ids)  # right
    assert padded.mask.sum() == plain.mask.sum() and padded.num_items_in_batch == plain.num_items_in_batch
    assert padded.select(torch.tensor([1])).padded_width(3) == 16 and plain.padded_width(3) == 3
    c = plain.completion_ids.shape[1]
    results = []
    for batch in (plain, padded):
        for chunked in (False, True):
            model.zero_grad()
            layouts = ("shared_prefix" if share_prefix else "padded",)
            scored = token_logps(model, batch, PassSettings(0.9, chunked_head=chunked, layouts=layouts))
            logps, ent = scored.logps, scored.entropies
            loss, _ = policy_loss(logps, None, batch.advantages, batch.mask, _loss_args())
            loss.backward()
            grads = [p.grad.clone() for p in model.parameters()]
            results.append((logps[:, :c].detach(), ent[:, :c].detach(), loss.item(), grads))
    m = plain.mask.bool()
    for logps, ent, loss, grads in results[1:]:
        torch.testing.assert_close(logps[m], results[0][0][m], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ent[m], results[0][1][m], rtol=1e-5, atol=1e-5)
        assert loss == pytest.approx(results[0][2], rel=1e-5, abs=1e-7)
        for grad, want in zip(grads, results[0][3]):
            torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6)


def _loss_args():
    return GRPOConfig(**_small(loss_type="grpo"))


def test_pad_to_multiple_of_in_training(tmp_path):
    rows = {}
    for n in (None, 16):
        tok = make_tokenizer()
        trainer = GRPOTrainer(
            model=make_model(tok),
            reward_funcs=length_reward,
            train_dataset=chat_dataset(),
            args=cfg(tmp_path / str(n), pad_to_multiple_of=n, beta=0.1, num_iterations=2, max_steps=2),
            processing_class=tok,
        )
        trainer.engine = ScriptedEngine(tok)
        trainer.train()
        batch = trainer.parts.buffer.slices[0]
        rows[n] = trainer.state.log_history
        if n:  # the batch the steps trained on, its old and reference log-probs too
            for t in (batch.prompt_ids, batch.completion_ids, batch.old_logps, batch.ref_logps):
                assert t.shape[1] % 16 == 0
    for a, b in zip(rows[None], rows[16]):
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed not installed")
def test_sync_ref_model_under_zero3(tiny_model_dir, tmp_path):
    """Two steps of sync_ref_model (every step) at 2 processes under DeepSpeed ZeRO-3, which partitions the
    reference too (distributed_job.py +sync): the mixed reference and the KL against it equal one process's."""
    from support.launch import launch, side_by_side

    (one, row1), (two, row2) = side_by_side(
        lambda: launch(1, tmp_path / "one", tiny_model_dir, "dapo", "ddp+sync"),
        lambda: launch(2, tmp_path / "two", tiny_model_dir, "dapo", "zero3+sync"),
    )
    assert row2["engine"] == "zero3" and row2["reference_sharded"] is True and row2["step"] == 2
    assert row2["kl"] == pytest.approx(row1["kl"], rel=1e-5) and row1["kl"] > 0
    reference1, reference2 = (torch.load(tmp_path / run / "reference.pt") for run in ("one", "two"))
    initial = torch.load(tmp_path / "one" / "initial.pt")
    for name, value in reference1.items():
        torch.testing.assert_close(reference2[name], value, rtol=1e-5, atol=1e-7)
    assert any(not torch.equal(reference1[n], initial[n]) for n in initial)  # the reference moved
