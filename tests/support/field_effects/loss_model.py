"""Effects of the loss and model fields: the loss math's parameters (a loss computed on a fixed small batch differs
from the default's), the advantages' settings (the trainer's advantages of fixed rewards differ), the reference
model and its TR-DPO sync, the entropy bonus and its controller, the model's loading and head, the MoE router loss
and the training batch's padding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from support.field_effects import Setting, effect
from support.rewards import length_reward
from support.runs import chat_dataset

F64 = torch.float64
# test_losses.py's hand-worked batch: B=2, T=3 (the last token of row 1 is padding), off-policy ratios and a
# reference whose log-probs differ from the policy's
LOGPS = [[-1.0, -2.0, -0.5], [-1.0, -1.0, -7.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
ADV = [2.0, -1.0]
RATIOS = [[1.5, 0.5, 1.1], [1.5, 0.5, 3.0]]
REF_OFFSETS = [[0.7, 0.0, -0.7], [-0.7, 0.7, 5.0]]


def _loss(config, on_policy=False):
    """(loss, d loss / d logps) of policy_loss on the fixed batch under `config`."""
    from grpo.algo.losses import LossParams, policy_loss

    lp = torch.tensor(LOGPS, dtype=F64, requires_grad=True)
    old = None if on_policy else lp.detach() - torch.log(torch.tensor(RATIOS, dtype=F64))
    ref = lp.detach() + torch.tensor(REF_OFFSETS, dtype=F64)
    adv, mask = torch.tensor(ADV, dtype=F64), torch.tensor(MASK, dtype=F64)
    loss, _ = policy_loss(lp, old, adv, mask, LossParams.of(config), ref_logps=ref)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.item(), grad


def _loss_differs(s: Setting, param=None, on_policy=False, **more):
    """LossParams carries the value, and the loss (or its gradient) differs from the default's."""
    from grpo.algo.losses import LossParams

    assert getattr(LossParams.of(s.config(**more)), param or s.field) == s.value
    (loss, grad), (default_loss, default_grad) = (
        _loss(s.config(**more), on_policy),
        _loss(s.default_config(**more), on_policy),
    )
    assert loss != pytest.approx(default_loss, abs=1e-9) or not torch.allclose(grad, default_grad, atol=1e-9)


@effect("epsilon", 0.1)
def _epsilon(s: Setting):
    _loss_differs(s, param="epsilon_low")  # the low clip: row 1's ratio 0.5 clips at 0.9 instead of 0.8


@effect("epsilon_high", 0.3)
def _epsilon_high(s: Setting):
    _loss_differs(s)  # row 0's ratio 1.5 clips at 1.3 instead of 1.2


@effect("delta", 1.1)
def _delta(s: Setting):
    _loss_differs(s)  # the unclipped branch is capped at 1.1


@effect("beta", 0.04)
def _beta(s: Setting):
    _loss_differs(s)  # the KL term
    assert s.trainer().ref_model is not None  # a reference model is loaded (beta = 0: none)


@effect("use_bias_correction_kl", False)
def _use_bias_correction_kl(s: Setting):
    _loss_differs(s, on_policy=True, beta=0.04)  # on-policy the KL gradient changes (r = 1, dr/dlogp = 1)


@effect("importance_sampling_level", "sequence")
def _importance_sampling_level(s: Setting):
    _loss_differs(s)


@effect("loss_type", "grpo")
def _loss_type(s: Setting):
    _loss_differs(s)


@effect("sapo_temperature_neg", 2.0)
def _sapo_temperature_neg(s: Setting):
    _loss_differs(s, loss_type="sapo")  # row 1 has a negative advantage


@effect("sapo_temperature_pos", 2.0)
def _sapo_temperature_pos(s: Setting):
    _loss_differs(s, loss_type="sapo")


@effect("vespo_k_pos", 1.0)
def _vespo_k_pos(s: Setting):
    _loss_differs(s, loss_type="vespo")  # row 0's sequence ratio is 0.825, row 1's 0.75


@effect("vespo_lambda_pos", 1.0)
def _vespo_lambda_pos(s: Setting):
    _loss_differs(s, loss_type="vespo")


@effect("vespo_k_neg", 1.0)
def _vespo_k_neg(s: Setting):
    _loss_differs(s, loss_type="vespo")


@effect("vespo_lambda_neg", 1.0)
def _vespo_lambda_neg(s: Setting):
    _loss_differs(s, loss_type="vespo")


@effect("max_completion_length", 16)
def _max_completion_length(s: Setting):
    # differs on purpose (256, TRL 512): completions stop at 16 tokens; dr_grpo divides by it
    _loss_differs(s, loss_type="dr_grpo")
    trainer = s.train()
    assert trainer.parts.buffer.slices[0].completion_ids.shape[1] == 16  # the untrained model rarely stops by itself


# ---- advantages ---------------------------------------------------------------------------------------------

REWARDS = torch.tensor([[1.0, 0.0], [2.0, 5.0], [0.0, 1.0], [4.0, 1.0], [0.0, 0.0], [1.0, 3.0], [3.0, 0.0], [1.0, 1.0]])


def _other_reward(completions, **kwargs):
    return [float(len(set(str(c)))) for c in completions]


def _advantages_differ(s: Setting):
    """The trainer's advantages of fixed rewards (2 functions, 2 groups of 4) differ from the default's."""
    funcs = [length_reward, _other_reward]
    rewards = SimpleNamespace(rewards=REWARDS)
    mine = s.trainer(reward_funcs=funcs)._advantages(rewards).advantages
    default = s.default_trainer(reward_funcs=funcs)._advantages(rewards).advantages
    assert not torch.allclose(mine, default)


@effect("reward_weights", [1.0, 0.25])
def _reward_weights(s: Setting):
    _advantages_differ(s)


@effect("multi_objective_aggregation", "normalize_then_sum")
def _multi_objective_aggregation(s: Setting):
    _advantages_differ(s)


@effect("scale_rewards", "batch")
def _scale_rewards(s: Setting):
    _advantages_differ(s)


# ---- the training step ----------------------------------------------------------------------------------------


def _scripted(trainer):
    """Completions by a fixed rule (support/scripted.py), so runs with and without a field see the same ones."""
    from support.scripted import ScriptedEngine

    trainer.engine = ScriptedEngine(trainer.processing_class)
    return trainer


@effect("num_iterations", 2)
def _num_iterations(s: Setting):
    trainer = _scripted(s.trainer(max_steps=2))
    calls = []
    generate = trainer.engine.generate
    trainer.engine.generate = lambda requests: calls.append(1) or generate(requests)
    trainer.train()
    assert len(calls) == 1 and trainer._needs_old_logps()  # step 2 trains on step 1's batch again, off-policy


@effect("mask_truncated_completions", True)
def _mask_truncated_completions(s: Setting):
    trainer = _scripted(s.trainer())
    trainer.train()
    batch = trainer.parts.buffer.slices[0]
    end = trainer.processing_class.convert_tokens_to_ids("<|im_end|>")
    truncated = ~(batch.completion_ids == end).any(-1)  # 8 letters without the end-of-turn token
    assert truncated.any() and (~truncated).any()
    assert (batch.mask.sum(-1) == 0).equal(truncated)  # truncated rows leave the loss


@effect("top_entropy_quantile", 0.5)
def _top_entropy_quantile(s: Setting):
    from grpo import trainer as trainer_module

    kept = []
    original = trainer_module.high_entropy_mask

    def recording(*args):
        kept.append(original(*args))
        return kept[-1]

    trainer_module.high_entropy_mask = recording
    try:
        _scripted(s.trainer()).train()
    finally:
        trainer_module.high_entropy_mask = original
    assert len(kept) == 1  # one micro-batch: its mask keeps the top half of the tokens by entropy
    assert 0 < kept[0].sum() < kept[0].numel()


@effect("entropy_coef", 0.1)
def _entropy_coef(s: Setting):
    trainer = _scripted(s.trainer())
    trainer.train()
    row = trainer.state.log_history[-1]
    assert row["entropy_coef"] == 0.1
    assert row["loss"] == pytest.approx(row["policy_loss"] - 0.1 * row["entropy"], abs=1e-6)


@effect("use_adaptive_entropy", True)
def _use_adaptive_entropy(s: Setting):
    trainer = _scripted(s.trainer(entropy_coef=0.1, entropy_target=100.0))
    trainer.train()
    row = trainer.state.log_history[-1]
    # step 1 applies no bonus (no entropy measured yet), then the coefficient grows (entropy <= target)
    assert row["loss"] == pytest.approx(row["policy_loss"], abs=1e-7)
    assert row["entropy_coef"] == pytest.approx(0.105)


def _controller_after_one_step(config, entropy):
    from grpo.algo.entropy_control import EntropyController

    controller = EntropyController.of(config)
    controller.end_step(entropy, 1.0)
    return controller.coef


def _controller_differs(s: Setting, entropy: float, **more):
    more = dict(use_adaptive_entropy=True, entropy_coef=0.1, **more)
    mine = _controller_after_one_step(s.config(**more), entropy)
    assert mine != pytest.approx(_controller_after_one_step(s.default_config(**more), entropy))
    return mine


@effect("entropy_coef_min", 0.098)
def _entropy_coef_min(s: Setting):
    assert _controller_differs(s, entropy=5.0) == pytest.approx(0.098)  # 0.1 - 0.005 = 0.095, floored


@effect("entropy_coef_max", 0.102)
def _entropy_coef_max(s: Setting):
    assert _controller_differs(s, entropy=0.1) == pytest.approx(0.102)  # 0.1 + 0.005, capped


@effect("entropy_coef_delta", 0.05)
def _entropy_coef_delta(s: Setting):
    assert _controller_differs(s, entropy=0.1) == pytest.approx(0.15)


@effect("entropy_target", 1.0)
def _entropy_target(s: Setting):
    assert _controller_differs(s, entropy=0.5) == pytest.approx(0.105)  # 0.5 <= 1.0 (default 0.2: down)


# ---- the reference model and TR-DPO ---------------------------------------------------------------------------


def _mixed(s: Setting, max_steps=1, **more):
    """(reference before, policy after, reference after) for one parameter of a sync_ref_model run."""
    kwargs = dict(beta=0.1, sync_ref_model=True, max_steps=max_steps)
    kwargs.update(more)
    trainer = _scripted(s.trainer(**kwargs))
    before = trainer.ref_model.model.embed_tokens.weight.detach().clone()
    trainer.train()
    return (
        before,
        trainer.unwrapped_model.model.embed_tokens.weight.detach(),
        trainer.ref_model.model.embed_tokens.weight,
    )


@effect("sync_ref_model", True)
def _sync_ref_model(s: Setting):
    before, policy, after = _mixed(s, ref_model_sync_steps=1)
    torch.testing.assert_close(after, 0.6 * policy + 0.4 * before)  # off: the reference never changes


@effect("ref_model_mixup_alpha", 0.3)
def _ref_model_mixup_alpha(s: Setting):
    before, policy, after = _mixed(s, ref_model_sync_steps=1)
    torch.testing.assert_close(after, 0.3 * policy + 0.7 * before)


@effect("ref_model_sync_steps", 2)
def _ref_model_sync_steps(s: Setting):
    # two steps: one mix, after step 2 (every step would mix twice; the default 512, never)
    before, policy, after = _mixed(s, max_steps=2)
    torch.testing.assert_close(after, 0.6 * policy + 0.4 * before)


# ---- loading the model, its head, the router loss, the batch's padding -----------------------------------------


@effect("model_init_kwargs", {"dtype": "bfloat16"})
def _model_init_kwargs(s: Setting):
    assert s.trainer().unwrapped_model.dtype == torch.bfloat16  # default: float32


@effect("trust_remote_code", True)
def _trust_remote_code(s: Setting):
    from grpo.models import modeling

    seen = []
    original = modeling.from_pretrained_checked

    def recording(auto_class, kind, model_id, **kwargs):
        seen.append((kind, kwargs.get("trust_remote_code")))
        return original(auto_class, kind, model_id, **kwargs)

    modeling.from_pretrained_checked = recording
    try:
        s.trainer()
    finally:
        modeling.from_pretrained_checked = original
    assert ("model", True) in seen and ("tokenizer", True) in seen


@effect("disable_dropout", True)
def _disable_dropout(s: Setting):
    from transformers import AutoModelForCausalLM

    from grpo import GRPOTrainer

    def with_dropout():
        model = AutoModelForCausalLM.from_pretrained(s.model_dir)
        model.model.probe = torch.nn.Dropout(0.3)  # the tiny Llama has no dropout module of its own
        return model

    assert s.trainer(model=with_dropout()).unwrapped_model.model.probe.p == 0.0
    kept = with_dropout()
    GRPOTrainer(
        model=kept, reward_funcs=length_reward, train_dataset=chat_dataset(tasks=False), args=s.default_config()
    )
    assert kept.model.probe.p == 0.3  # the default leaves dropout alone


@effect("cast_lm_head_to_fp32", True)
def _cast_lm_head_to_fp32(s: Setting):
    from grpo.models.fp32_head import Float32Head

    model = s.trainer(model_init_kwargs={"dtype": "bfloat16"}, bf16=True).unwrapped_model
    assert isinstance(model.lm_head, Float32Head) and model.lm_head.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


@effect("router_aux_loss_coef", 0.5)
def _router_aux_loss_coef(s: Setting):
    from support.tiny import save_tiny_moe

    with pytest.raises(ValueError, match="router_aux_loss_coef is 0.5, but LlamaForCausalLM is not a mixture"):
        s.trainer()
    moe = save_tiny_moe(s.tmp_path / "moe")
    trainer = s.trainer(model=str(moe))
    trainer.train()
    row = trainer.state.log_history[-1]
    assert trainer.parts.loss_terms.aux_coef == 0.5 and row["aux_loss"] > 0  # default: the config's own 0.001


@effect("pad_to_multiple_of", 16)
def _pad_to_multiple_of(s: Setting):
    trainer = _scripted(s.trainer(beta=0.1))
    trainer.train()
    batch = trainer.parts.buffer.slices[0]
    for t in (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.mask, batch.ref_logps):
        assert t.shape[1] % 16 == 0  # default ("auto"): no padding beyond the longest row
