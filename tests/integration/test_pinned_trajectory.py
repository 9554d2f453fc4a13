"""Pinned trajectories: 5 optimizer steps on a tiny model with scripted completions, float32 on the CPU, every
numerics-relevant GRPOConfig field set explicitly. The per-step losses, gradient norms and a checksum of the final
parameters must equal the committed values, so a refactor that changes the numbers fails loudly. One run per
loss type (two passes over each generation and a KL term, `loss_<type>`), and two that vary the batching.

Tolerance: rtol 1e-5 (float32 on one machine gives the same bits run to run; the slack covers other CPUs'
kernels). When a change of the numbers is intended, say why in the commit and re-pin: run

    PYTHONPATH=tests .venv/bin/python tests/integration/test_pinned_trajectory.py

which prints the new `PINNED` dict to paste below.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.config.grpo_fields import LOSS_TYPES
from support.scripted import ScriptedEngine
from support.tiny import make_model, make_tokenizer

COMMON = dict(
    bf16=False,
    fp16=False,
    use_cpu=True,
    seed=0,
    max_steps=5,
    learning_rate=3e-3,
    weight_decay=0.01,
    adam_beta1=0.9,
    adam_beta2=0.999,
    adam_epsilon=1e-8,
    max_grad_norm=1.0,
    lr_scheduler_type="linear",
    warmup_steps=0,
    warmup_ratio=0.0,
    num_generations=4,
    max_completion_length=8,
    temperature=0.9,
    top_p=1.0,
    top_k=0,
    min_p=None,
    repetition_penalty=1.0,
    epsilon=0.2,
    epsilon_high=0.28,
    delta=None,
    importance_sampling_level="token",
    scale_rewards="group",
    reward_weights=[1.0, 0.5],
    multi_objective_aggregation="sum_then_normalize",
    mask_truncated_completions=False,
    top_entropy_quantile=1.0,
    use_bias_correction_kl=False,
    entropy_coef=0.0,
    use_adaptive_entropy=False,
    sync_ref_model=False,
    cast_lm_head_to_fp32=False,
    router_aux_loss_coef=None,
    pad_to_multiple_of=None,
    packing="padded",
    shuffle_dataset=True,
    gradient_checkpointing=False,
    disable_dropout=True,
    logging_steps=1,
    save_strategy="no",
    disable_tqdm=True,
    report_to="none",
)
RUNS = {
    # steps_per_generation 4 over 2 accumulated micro-steps: one generation feeds 2 optimizer steps, off-policy
    "dapo": dict(
        loss_type="dapo",
        beta=0.0,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        num_iterations=1,
    ),
    # two passes over each generation, a KL term against the frozen reference
    "grpo_kl": dict(
        loss_type="grpo",
        beta=0.04,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=2,
    ),
}
# every loss type: two passes over each generation (the second off-policy), a KL term against the reference
RUNS.update(
    {
        f"loss_{loss_type}": dict(
            loss_type=loss_type,
            beta=0.04,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=1,
            steps_per_generation=1,
            num_iterations=2,
        )
        for loss_type in LOSS_TYPES
        if loss_type != "grpo"  # grpo_kl is that run
    }
)
# packing="tree": the same two batchings as one token tree per prompt group (their numbers equal the padded runs'
# to float32 rounding: test_tree_trajectories_follow_the_padded_ones)
RUNS.update({f"{name}_tree": dict(RUNS[name], packing="tree") for name in ("dapo", "grpo_kl")})
# what each loss logs beyond the common metrics
LOSS_METRIC = {"cispo": "cispo_clip_ratio", "vespo": "vespo/phi_seq_mean", "sapo": "entropy"}
PINNED = {
    "dapo_tree": {
        "loss": [
            -0.04116620123386383,
            -0.780504435300827,
            -0.21898464858531952,
            -0.5587687194347382,
            -0.12478454038500786,
        ],
        "grad_norm": [
            0.8085532188415527,
            2.448718547821045,
            1.0950855016708374,
            1.7066608667373657,
            0.7162492871284485,
        ],
        "reward": [1.1484375, 1.140625, 1.140625],
        "param_sum": 158.32359042108715,
        "param_weighted": -40.604119141966976,
    },
    "grpo_kl_tree": {
        "loss": [
            -1.1175870895385742e-08,
            -0.09911815077066422,
            0.0013606492429971695,
            -0.03258755803108215,
            0.0024347975850105286,
        ],
        "grad_norm": [
            1.737221598625183,
            0.6956425905227661,
            1.0735501050949097,
            1.0212461948394775,
            1.2452868223190308,
        ],
        "reward": [1.171875, 1.125, 1.171875],
        "param_sum": 160.0112689042819,
        "param_weighted": -42.645897667370036,
    },
    "dapo": {
        "loss": [
            -0.04116620495915413,
            -0.7805043458938599,
            -0.21898464858531952,
            -0.5587686896324158,
            -0.12478451058268547,
        ],
        "grad_norm": [0.808553159236908, 2.448718547821045, 1.0950855016708374, 1.7066606283187866, 0.7162491083145142],
        "reward": [1.1484375, 1.140625, 1.140625],
        "param_sum": 158.3235914213276,
        "param_weighted": -40.604114054180855,
    },
    "grpo_kl": {
        "loss": [
            -1.1175870895385742e-08,
            -0.09911813586950302,
            0.0013606492429971695,
            -0.03258752077817917,
            0.0024347901344299316,
        ],
        "grad_norm": [
            1.737221598625183,
            0.6956425905227661,
            1.0735501050949097,
            1.0212464332580566,
            1.2452868223190308,
        ],
        "reward": [1.171875, 1.125, 1.171875],
        "param_sum": 160.01126935301568,
        "param_weighted": -42.64589893894549,
    },
    "loss_bnpo": {
        "loss": [
            -0.3766002655029297,
            -0.4863678216934204,
            -0.35253793001174927,
            -0.39543619751930237,
            -0.3061560392379761,
        ],
        "grad_norm": [
            1.4500302076339722,
            0.9007558822631836,
            1.045609951019287,
            1.0928633213043213,
            0.9409055709838867,
        ],
        "reward": [1.171875, 1.125, 1.171875],
        "param_sum": 159.86641960452857,
        "param_weighted": -40.027471756126715,
    },
    "loss_cispo": {
        "loss": [0.48728299140930176, 0.4527776539325714, 0.4158592224121094, 0.4044509828090668, 0.3424288034439087],
        "grad_norm": [
            0.4060084819793701,
            0.32854723930358887,
            0.26898428797721863,
            0.25434011220932007,
            0.23296989500522614,
        ],
        "reward": [1.171875, 1.125, 1.171875],
        "param_sum": 159.2852746723604,
        "param_weighted": -40.335467926576484,
    },
    "loss_dapo": {
        "loss": [
            -0.3766002655029297,
            -0.4863678216934204,
            -0.35253793001174927,
            -0.39543619751930237,
            -0.3061560392379761,
        ],
        "grad_norm": [
            1.4500302076339722,
            0.9007558822631836,
            1.045609951019287,
            1.0928633213043213,
            0.9409055709838867,
        ],
        "reward": [1.171875, 1.125, 1.171875],
        "param_sum": 159.86641960452857,
        "param_weighted": -40.027471756126715,
    },
    "loss_dr_grpo": {
        "loss": [
            -0.2530283033847809,
            -0.326778382062912,
            -0.22032803297042847,
            -0.24648219347000122,
            -0.20570127665996552,
        ],
        "grad_norm": [0.9742391705513, 0.6051954627037048, 0.652606725692749, 0.6836163997650146, 0.6312134861946106],
        "reward": [1.171875, 1.125, 1.171875],
        "param_sum": 159.97041189099787,
        "param_weighted": -40.167470757728324,
    },
    "loss_luspo": {
        "loss": [-2.024226665496826, -2.614226818084717, -1.7627208232879639, -1.9744096994400024, -1.6457453966140747],
        "grad_norm": [7.7939133644104, 4.8415632247924805, 5.2302117347717285, 5.47015905380249, 5.072085857391357],
        "reward": [1.171875, 1.125, 1.171875],
        "param_sum": 159.8458186463124,
        "param_weighted": -39.995382905991164,
    },
    "loss_sapo": {
        "loss": [
            -0.03744093328714371,
            -0.18280112743377686,
            -0.033292800188064575,
            -0.06912583112716675,
            -0.03128857910633087,
        ],
        "grad_norm": [1.737221598625183, 1.3523688316345215, 1.122219204902649, 1.0202322006225586, 1.2762422561645508],
        "reward": [1.171875, 1.125, 1.171875],
        "param_sum": 161.21346559970902,
        "param_weighted": -42.80970341593161,
    },
    "loss_vespo": {
        "loss": [1.740296483039856, -0.7893171906471252, 1.5460221767425537, -0.6150509715080261, 1.276556372642517],
        "grad_norm": [
            1.4500302076339722,
            0.7567472457885742,
            1.2768679857254028,
            0.7739590406417847,
            1.0619663000106812,
        ],
        "reward": [1.171875, 1.125, 1.171875],
        "param_sum": 159.1619390424146,
        "param_weighted": -40.965411358435404,
    },
}


def token_length_reward(completion_ids, **kwargs):
    return [len(ids) / 8.0 for ids in completion_ids]


def variety_reward(completions, **kwargs):
    texts = [c[0]["content"] for c in completions]
    return [len(set(t)) / max(len(t), 1) for t in texts]


def trajectory(name: str, output_dir: str) -> dict:
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, seed=0)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(16)])
    args = GRPOConfig(output_dir=output_dir, **{**COMMON, **RUNS[name]})
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[token_length_reward, variety_reward],
        train_dataset=dataset,
        args=args,
        processing_class=tokenizer,
    )
    trainer.engine = ScriptedEngine(tokenizer)
    trainer.train()
    if args.packing == "tree":  # its pieces ran as trees (the tree runs pin the tree pass)
        assert set(trainer.training_pass.laid_out) == {"trees"}
    history = trainer.state.log_history
    params = [p.detach().double() for p in trainer.unwrapped_model.parameters()]
    weights = [torch.arange(p.numel(), dtype=torch.float64).remainder(7).sub(3).reshape(p.shape) for p in params]
    return {
        "metrics": sorted(history[-1]),
        "kl": [row.get("kl") for row in history],
        "loss": [row["loss"] for row in history],
        "grad_norm": [row["grad_norm"] for row in history],
        "reward": [row["reward"] for row in history if "reward" in row],
        "param_sum": sum(p.sum().item() for p in params),
        "param_weighted": sum((p * w).sum().item() for p, w in zip(params, weights)),
    }


@pytest.mark.parametrize("name", sorted(RUNS))
def test_trajectory_is_pinned(tmp_path, name):
    got = trajectory(name, str(tmp_path / name))
    want = PINNED[name]
    assert len(got["loss"]) == 5
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    if RUNS[name]["beta"] > 0:
        assert got["kl"][-1] > 0  # the policy has moved away from the reference
    loss_type = RUNS[name]["loss_type"]
    assert LOSS_METRIC.get(loss_type, "clip_ratio/region_mean") in got["metrics"]


@pytest.mark.parametrize("name", ["dapo", "grpo_kl"])
def test_tree_trajectories_follow_the_padded_ones(name):
    """packing="tree" computes the padded pass's numbers in another order: the pinned runs agree to float32
    rounding (the runs themselves are checked against their pins above)."""
    tree, padded = PINNED[f"{name}_tree"], PINNED[name]
    for key in padded:
        assert tree[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-7), key


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: trajectory(name, f"{tmp}/{name}") for name in sorted(RUNS)}
        pinned = {name: {k: v for k, v in run.items() if k not in ("metrics", "kl")} for name, run in runs.items()}
        print("PINNED = " + repr(pinned))
