"""The sampling/* metrics for grpo's own engines (TRL 1.16 logs them for vLLM only): taken from the training pass
when the batch is on-policy, near zero when the sampler is the policy, growing when they part; in-process
engines never get the importance weight itself (as 1.16)."""

from __future__ import annotations

import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.learner.batch import collate
from support.rewards import length_reward
from support.runs import BASE, chat_dataset, generate


def trainer(model_dir, tmp_path, **cfg):
    args = GRPOConfig(output_dir=str(tmp_path), **{**BASE, "bf16": False, **cfg})
    return GRPOTrainer(model=model_dir, reward_funcs=length_reward, train_dataset=chat_dataset(tasks=False), args=args)


def mismatch(t, perturbation: float) -> dict[str, float]:
    """The sampling/* metrics of one generation batch whose policy moved by `perturbation` after sampling."""
    rollout = generate(t, t.parts.producer.rows(0)).rollout
    batch = collate(rollout, torch.zeros(len(rollout)), t.processing_class.pad_token_id, mask_truncated=False)
    with torch.no_grad():
        for p in t.unwrapped_model.parameters():
            p.add_(torch.randn_like(p) * perturbation)
    logps = t.training_pass.train(t.model, batch, entropy_grad=False).logps
    rho, sampler, stats = t.parts.correction(logps, batch.old_logps, batch.sampling_logps, batch.mask)
    assert rho is None and sampler is None  # in-process engines: metrics only
    return {name: stat.local() for name, stat in stats.items()}


def test_fast_engine_mismatch_is_near_zero_on_policy_and_grows_when_the_policy_moves(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    t = trainer(tiny_model_dir, tmp_path)
    assert t.engine.name == "fast"
    same = mismatch(t, 0.0)
    assert same["sampling/sampling_logp_difference/max"] < 1e-4
    assert abs(same["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3
    moved = mismatch(t, 0.05)
    assert moved["sampling/sampling_logp_difference/mean"] > 100 * max(
        same["sampling/sampling_logp_difference/mean"], 1e-6
    )
    assert abs(moved["sampling/importance_sampling_ratio/mean"] - 1) > 10 * abs(
        same["sampling/importance_sampling_ratio/mean"] - 1
    )


def test_the_metrics_are_logged_for_every_engine(tiny_model_dir, tmp_path):
    for kwargs in ({}, {"generation_kwargs": {"do_sample": True}}):  # the fast engine, then the plain one
        t = trainer(tiny_model_dir, tmp_path / str(len(kwargs)), **kwargs)
        t.train()
        row = t.state.log_history[-1]
        assert row["sampling/sampling_logp_difference/max"] < 1e-3, t.engine.name
        assert "sampling/importance_sampling_ratio/clipped_fraction" in row
