"""Tests for grpo.algo.losses against the shared spec §2 (loss math), §8 (loss metrics) and §10.1 (entropy mask).

Hand-worked examples share one small batch (B=2, T=3, the last token of row 1 is padding):

    logps = [[-1.0, -2.0, -0.5],      mask = [[1, 1, 1],      A = [2.0, -1.0]
             [-1.0, -1.0, -7.0]]              [1, 1, 0]]

so sum_t m*logp = -3.5 (row 0) and -2.0 (row 1), and there are 5 active tokens. Off-policy cases build
old_logps = logps - log(r) for a chosen ratio table r. Default config: epsilon = epsilon_high = 0.2 (clip range
[0.8, 1.2]), max_completion_length = 4, N = num_items_in_batch = 5 unless passed.

A slow per-row / per-token reference written from the spec formulas is compared with `policy_loss` on random
inputs (loss, gradient and metrics).
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo.algo.losses import LOSS_TYPES as TABLE
from grpo.algo.losses import LossParams, LossScale, entropy_bonus, high_entropy_mask, kl_k3, policy_loss
from grpo.config import LOSS_TYPES, GRPOConfig
from support.float64 import F64, t64

LN2 = math.log(2.0)

LOGPS = [[-1.0, -2.0, -0.5], [-1.0, -1.0, -7.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
ADV = [2.0, -1.0]
# The main off-policy ratio table. Row 0 (A=2>0): 1.5 is clipped high (-> 1.2), 0.5 is not clipped (A>0 keeps the
# smaller r), 1.1 is inside the range. Row 1 (A=-1<0): 1.5 keeps r (max), 0.5 is clipped low (-> 0.8); 3.0 is padding.
RATIOS = [[1.5, 0.5, 1.1], [1.5, 0.5, 3.0]]

CLIP_KEYS = {
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
}
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def make_cfg(loss_type: str = "dapo", **kw) -> GRPOConfig:
    kw.setdefault("max_completion_length", 4)
    return GRPOConfig(output_dir="unused", loss_type=loss_type, per_device_train_batch_size=4, num_generations=2, **kw)


def run(
    loss_type="dapo",
    ratios=None,
    adv=ADV,
    logps=LOGPS,
    mask=MASK,
    ref_offsets=None,
    entropy_mask=None,
    num_items=None,
    **cfg_kw,
):
    """policy_loss on the hand-worked batch; returns (loss value, d loss / d logps, metrics)."""
    lp = torch.tensor(logps, dtype=F64, requires_grad=True)
    old = None if ratios is None else lp.detach() - torch.log(t64(ratios))
    ref = None if ref_offsets is None else lp.detach() + t64(ref_offsets)
    em = None if entropy_mask is None else t64(entropy_mask)
    loss, metrics = policy_loss(
        lp,
        old,
        t64(adv),
        t64(mask),
        make_cfg(loss_type, **cfg_kw),
        ref_logps=ref,
        num_items_in_batch=num_items,
        entropy_mask=em,
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.item(), grad, metrics


def assert_grad(grad: torch.Tensor, expected) -> None:
    torch.testing.assert_close(grad, t64(expected), rtol=1e-6, atol=1e-9)


def assert_metrics(metrics: dict, expected: dict) -> None:
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key


NO_CLIP = {k: 0.0 for k in CLIP_KEYS}

# ---- on-policy (old_logps=None): every ratio is 1 and its gradient is d r / d logp = 1 ---------------------------
# clipped family: L_t = -A (r=1 is inside the clip range), d L_t / d logp_t = -A.
#   grpo    : mean_i(mean_t L) = (-2 + 1)/2 = -0.5;        grad = -A_i m_t / (|o_i| B) -> row0 -2/6, row1 1/4
#   bnpo    : sum L / 5 = (-6 + 2)/5 = -0.8;                grad = -A_i m_t / 5
#   dr_grpo : sum L / (B * 4) = -4/8 = -0.5;                grad = -A_i m_t / 8
#   dapo    : sum L / N = -0.8;                             grad = -A_i m_t / N
#   luspo   : mean_i(sum_t m L) = (-6 + 2)/2 = -2;          grad = -A_i m_t / B
# cispo: c = min(1, epsilon_high=0.2) = 0.2 (absolute cap), L_t = -0.2 A logp_t:
#   sum = -0.4*(-3.5) + 0.2*(-2) = 1.0 -> 1.0/5 = 0.2;     grad = -0.2 A_i m_t / 5 -> row0 -0.08, row1 0.04
#   cispo_clip_ratio = mean over active tokens of [1 > 0.2 and A>0] = 3/5
# sapo: L_t = -(4/tau) sigmoid(0) A = -2A/tau (tau_pos=1, tau_neg=1.05): row0 -4, row1 2/1.05; grpo aggregation
#   loss = (-4 + 2/1.05)/2 = -1.047619...;                  grad = -4 s(1-s) r A / (|o_i| B) = -A / (|o_i| B)
# vespo: W = 1 -> phi = 1 (REINFORCE): sum -A logp m = 7 - 2 = 5 -> 5/5 = 1.0;  grad = -A_i m_t / 5
ON_POLICY = {
    "grpo": (-0.5, [[-1 / 3] * 3, [0.25, 0.25, 0.0]], NO_CLIP),
    "bnpo": (-0.8, [[-0.4] * 3, [0.2, 0.2, 0.0]], NO_CLIP),
    "dr_grpo": (-0.5, [[-0.25] * 3, [0.125, 0.125, 0.0]], NO_CLIP),
    "dapo": (-0.8, [[-0.4] * 3, [0.2, 0.2, 0.0]], NO_CLIP),
    "luspo": (-2.0, [[-1.0] * 3, [0.5, 0.5, 0.0]], NO_CLIP),
    "cispo": (0.2, [[-0.08] * 3, [0.04, 0.04, 0.0]], {"cispo_clip_ratio": 0.6}),
    "sapo": ((-4 + 2 / 1.05) / 2, [[-1 / 3] * 3, [0.25, 0.25, 0.0]], {}),
    "vespo": (1.0, [[-0.4] * 3, [0.2, 0.2, 0.0]], {"vespo/phi_seq_mean": 1.0}),
}

EXPECTED_KEYS = {
    **{lt: CLIP_KEYS for lt in CLIPPED},
    "cispo": {"cispo_clip_ratio"},
    "sapo": set(),
    "vespo": {"vespo/phi_seq_mean"},
}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_on_policy_literal(loss_type):
    loss, grad, metrics = run(loss_type)
    exp_loss, exp_grad, exp_metrics = ON_POLICY[loss_type]
    assert loss == pytest.approx(exp_loss, rel=1e-6)
    assert_grad(grad, exp_grad)
    assert set(metrics) == EXPECTED_KEYS[loss_type]
    assert_metrics(metrics, exp_metrics)


def test_on_policy_old_none_equals_detached_logps():
    for loss_type in LOSS_TYPES:
        a = run(loss_type)
        b = run(loss_type, ratios=[[1.0] * 3] * 2)
        assert a[0] == pytest.approx(b[0], abs=1e-12)
        torch.testing.assert_close(a[1], b[1])


def test_dapo_divides_by_num_items_exactly_as_passed():
    # N = 10 instead of the default 5 (the local active-token count): loss and gradient halve.
    loss, grad, _ = run("dapo", num_items=10.0)
    assert loss == pytest.approx(-0.4, abs=1e-12)
    assert_grad(grad, [[-0.2] * 3, [0.1, 0.1, 0.0]])
    loss, grad, _ = run("dapo", num_items=torch.tensor(2.5, dtype=F64))
    assert loss == pytest.approx(-1.6, abs=1e-12)
    assert_grad(grad, [[-0.8] * 3, [0.4, 0.4, 0.0]])
    # bnpo and grpo ignore num_items_in_batch
    assert run("bnpo", num_items=10.0)[0] == pytest.approx(-0.8)
    assert run("grpo", num_items=10.0)[0] == pytest.approx(-0.5)


def test_every_loss_type_the_config_accepts_has_one_table_entry():
    """The config accepts exactly the table's names; each entry says how accumulation normalizes it."""
    assert set(LOSS_TYPES) == set(TABLE)
    for name in LOSS_TYPES:
        entry = TABLE[name]
        assert callable(entry.objective) and callable(entry.aggregate) and "arXiv" in entry.paper
        assert entry.normalization in ("tokens", "accumulation")
        assert make_cfg(name).loss_type == name
    with pytest.raises(ValueError, match="loss_type"):
        make_cfg("ppo")


def test_loss_params_are_the_configs_values():
    params = LossParams.of(make_cfg("cispo", epsilon=0.3, epsilon_high=5.0, beta=0.1, delta=None))
    assert (params.loss_type, params.epsilon_low, params.epsilon_high, params.beta) == ("cispo", 0.3, 5.0, 0.1)
    assert LossParams.of(params) is params
    assert LossParams.of(make_cfg("grpo", epsilon=0.25)).epsilon_high == 0.25  # None -> epsilon


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_scale_applies_the_table_normalization(loss_type):
    """With a LossScale, "tokens" losses divide their token sum by N/P x GA/spg (TRL 1.16) and every other loss
    is divided by GA; hand-computed from the unscaled loss."""
    scale = LossScale(tokens=12.0, processes=2, accumulation_steps=3, steps_per_generation=2)
    lp = torch.tensor(LOGPS, dtype=F64, requires_grad=True)
    old = lp.detach() - torch.log(t64(RATIOS))
    params = LossParams.of(make_cfg(loss_type))
    if TABLE[loss_type].normalization == "tokens":
        expected, _ = policy_loss(lp, old, t64(ADV), t64(MASK), params, num_items_in_batch=12.0 / 2 * 3 / 2)
    else:
        unscaled, _ = policy_loss(lp, old, t64(ADV), t64(MASK), params)
        expected = unscaled / 3
    scaled, _ = policy_loss(lp, old, t64(ADV), t64(MASK), params, scale=scale)
    assert scaled.item() == pytest.approx(expected.item(), rel=1e-12)
    assert scale.token_divisor() == 9.0 and LossScale(tokens=0.0).token_divisor() == 1.0  # never 0


# ---- off-policy, token level, RATIOS -------------------------------------------------------------------------
# clipped family, per token L = -min(r A, clip(r) A):
#   row0 (A=2):  r=1.5 -> -2*min(1.5, 1.2) = -2.4 (clipped high, d/dlogp = 0)
#                r=0.5 -> -2*min(0.5, 0.8) = -1.0 (r branch, d/dlogp = -A r = -1.0)
#                r=1.1 -> -2*1.1        = -2.2 (in range, d/dlogp = -A r = -2.2)       row sum -5.6
#   row1 (A=-1): r=1.5 -> max(1.5, 1.2)  =  1.5 (r branch, d/dlogp = -A r = 1.5)
#                r=0.5 -> max(0.5, 0.8)  =  0.8 (clipped low, 0)                       row sum  2.3
#   grpo    = (-5.6/3 + 2.3/2)/2 = -0.358333;  grad row0 /6, row1 /4
#   bnpo    = (-5.6 + 2.3)/5 = -0.66;          grad /5
#   dr_grpo = -3.3/8 = -0.4125;                grad /8
#   dapo    = -3.3/5 = -0.66;                  grad /5
#   luspo   = (-5.6 + 2.3)/2 = -1.65;          grad /2
# clip metrics: low = [r<0.8 & A<0] only at (1,1); high = [r>1.2 & A>0] only at (0,0); padding ignored:
#   low_mean = 1/5, high_mean = 1/5, region = 2/5, per-sequence low = [0, 1/2] -> low_min 0,
#   per-sequence high = [1/3, 0] -> high_max 1/3
RAW_GRAD = [[0.0, -1.0, -2.2], [1.5, 0.0, 0.0]]
OFF_CLIP_METRICS = {
    "clip_ratio/low_mean": 0.2,
    "clip_ratio/high_mean": 0.2,
    "clip_ratio/region_mean": 0.4,
    "clip_ratio/low_min": 0.0,
    "clip_ratio/high_max": 1 / 3,
}


def _scaled(rows, scales):
    return [[v / s for v in row] for row, s in zip(rows, scales, strict=True)]


OFF_POLICY_CLIPPED = {
    "grpo": (-0.358333333333333, _scaled(RAW_GRAD, [6, 4])),
    "bnpo": (-0.66, _scaled(RAW_GRAD, [5, 5])),
    "dr_grpo": (-0.4125, _scaled(RAW_GRAD, [8, 8])),
    "dapo": (-0.66, _scaled(RAW_GRAD, [5, 5])),
    "luspo": (-1.65, _scaled(RAW_GRAD, [2, 2])),
}


@pytest.mark.parametrize("loss_type", CLIPPED)
def test_off_policy_clipped_literal(loss_type):
    loss, grad, metrics = run(loss_type, ratios=RATIOS)
    exp_loss, exp_grad = OFF_POLICY_CLIPPED[loss_type]
    assert loss == pytest.approx(exp_loss, abs=1e-9)
    assert_grad(grad, exp_grad)
    assert set(metrics) == CLIP_KEYS
    assert_metrics(metrics, OFF_CLIP_METRICS)


def test_off_policy_cispo_default_cap_is_absolute_0_2():
    # epsilon_high=None -> epsilon = 0.2 used as an absolute cap: c = min(r, 0.2) = 0.2 for every ratio here,
    # so loss and gradient equal the on-policy ones: 0.2 and -0.2 A m / 5.
    cfg = make_cfg("cispo")
    assert cfg.epsilon_high == 0.2
    loss, grad, metrics = run("cispo", ratios=RATIOS)
    assert loss == pytest.approx(0.2, abs=1e-12)
    assert_grad(grad, [[-0.08] * 3, [0.04, 0.04, 0.0]])
    # [r > 0.2 and A > 0]: the three tokens of row 0 -> 3/5
    assert metrics == pytest.approx({"cispo_clip_ratio": 0.6})


def test_off_policy_cispo_cap_1_2():
    # c = sg(min(r, 1.2)): row0 [1.2, 0.5, 1.1], row1 [1.2, 0.5]; L = -c A logp
    #   row0: -(1.2*2*-1) - (0.5*2*-2) - (1.1*2*-0.5) = 2.4 + 2.0 + 1.1 = 5.5
    #   row1: c*logp = -1.2 - 0.5 = -1.7                  -> (5.5 - 1.7)/5 = 0.76
    # grad = -c A m / 5 (c detached): row0 -2c/5 = [-0.48, -0.2, -0.44], row1 c/5 = [0.24, 0.1, 0]
    # cispo_clip_ratio: [r > 1.2 and A > 0] only at (0,0) -> 1/5
    loss, grad, metrics = run("cispo", ratios=RATIOS, epsilon_high=1.2)
    assert loss == pytest.approx(0.76, abs=1e-9)
    assert_grad(grad, [[-0.48, -0.2, -0.44], [0.24, 0.1, 0.0]])
    assert metrics == pytest.approx({"cispo_clip_ratio": 0.2})


def test_off_policy_sapo_literal():
    # L_t = -(4/tau) sigmoid(tau (r - 1)) A; tau = 1 for A>0, 1.05 for A<=0.
    #   row0: -8 sigmoid(0.5), -8 sigmoid(-0.5), -8 sigmoid(0.1) = -4.979675, -3.020325, -4.199833; mean -4.066611
    #   row1: (4/1.05)[sigmoid(0.525) + sigmoid(-0.525)] = 4/1.05 (sigmoids of x and -x sum to 1); mean 1.904762
    #   loss = (-4.066611 + 1.904762)/2 = -1.080925
    # d L_t / d logp_t = -4 s (1-s) r A, then / (|o_i| B)
    loss, grad, metrics = run("sapo", ratios=RATIOS)
    assert loss == pytest.approx(-1.080924630924301, rel=1e-6)
    assert_grad(
        grad,
        [
            [-0.47000742440318904, -0.15666914146772967, -0.3657515256162416],
            [0.3503024337320222, 0.11676747791067407, 0.0],
        ],
    )
    assert metrics == {}


def test_sapo_temperatures():
    # tau_pos = tau_neg = 2 on-policy: L = -(4/2)(1/2) A = -A, gradient still -A/(|o|B) (weight 1 at r=1).
    loss, grad, _ = run("sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=2.0)
    assert loss == pytest.approx(-0.5, abs=1e-12)
    assert_grad(grad, [[-1 / 3] * 3, [0.25, 0.25, 0.0]])


def test_off_policy_vespo_literal():
    # W_i = exp(sum of active log ratios): row0 1.5*0.5*1.1 = 0.825, row1 1.5*0.5 = 0.75 (padding excluded).
    # row0 A>=0 (k=2, lambda=3): phi = 0.825^2 e^{3*0.175} = 1.150569
    # row1 A<0  (k=3, lambda=2): phi = 0.75^3  e^{2*0.25}  = 0.695554
    # loss = [-phi0*2*(-3.5) - phi1*(-1)*(-2)]/5 = (8.053980 - 1.391109)/5 = 1.332574
    # grad = -phi_i A_i m_t / 5 (phi detached): row0 -0.460227, row1 0.139111; phi_seq_mean = 0.923061
    loss, grad, metrics = run("vespo", ratios=RATIOS)
    assert loss == pytest.approx(1.33257426071858, rel=1e-6)
    assert_grad(grad, [[-0.4602274214712076] * 3, [0.13911085721532332] * 2 + [0.0]])
    assert metrics == pytest.approx({"vespo/phi_seq_mean": 0.9230614198773178}, rel=1e-6)


def test_vespo_custom_k_lambda_and_clamp():
    # k_pos=1, lambda_pos=1: phi = W e^{1-W}; row0 W=0.825 -> 0.825 e^{0.175} = 0.982765.
    # k_neg=1, lambda_neg=0 -> lambda clamped to 1e-4: phi = W e^{1e-4 (1-W)} = 0.75 e^{0.000025}.
    _, grad, metrics = run(
        "vespo", ratios=RATIOS, vespo_k_pos=1.0, vespo_lambda_pos=1.0, vespo_k_neg=1.0, vespo_lambda_neg=0.0
    )
    phi0 = 0.825 * math.exp(0.175)
    phi1 = 0.75 * math.exp(1e-4 * 0.25)
    assert_grad(grad, [[-2 * phi0 / 5] * 3, [phi1 / 5] * 2 + [0.0]])
    assert metrics["vespo/phi_seq_mean"] == pytest.approx((phi0 + phi1) / 2, rel=1e-6)
    # A huge log ratio: s = 3*20 (each token clamped to 20) -> log W clamped to 20 -> phi = exp(3 + 40 - 3e^20) = 0
    _, grad, metrics = run("vespo", ratios=[[math.exp(30.0)] * 3, [1.0, 1.0, 1.0]])
    assert_grad(grad, [[0.0] * 3, [0.2, 0.2, 0.0]])  # row 1 on-policy: phi=1, grad = -A m/5
    assert metrics["vespo/phi_seq_mean"] == pytest.approx(0.5, rel=1e-6)


# ---- sequence level (GSPO) -----------------------------------------------------------------------------------
# ratios row0 [1.5, 1, 1] -> r0 = exp(mean log) = 1.5^(1/3) = 1.144714 (inside [0.8, 1.2])
#        row1 [0.25, 1, 100 (padding)] -> r1 = exp(log(0.25)/2) = 0.5 (padding excluded from the mean)
# row0 (A=2): L = -2 r0 = -2.289428 on every token; d r0 / d logp_t = r0 / 3
# row1 (A=-1): L = max(0.5, 0.8) = 0.8, clipped low, gradient 0
# grpo: (-2.289428 + 0.8)/2 = -0.744714; grad row0 = -2 r0 / 3 / 2 = -0.381571
# dapo: (3*(-2.289428) + 2*0.8)/5 = -1.053657; grad row0 = 3 * (-2 r0/3) / 5 = -2 r0 / 5 = -0.457886
# metrics are per sequence: low = [0, 1] -> low_mean 0.5, high 0, region 0.5, low_min 0, high_max 0
GSPO_RATIOS = [[1.5, 1.0, 1.0], [0.25, 1.0, 100.0]]
GSPO_METRICS = {
    "clip_ratio/low_mean": 0.5,
    "clip_ratio/high_mean": 0.0,
    "clip_ratio/region_mean": 0.5,
    "clip_ratio/low_min": 0.0,
    "clip_ratio/high_max": 0.0,
}
R0 = 1.5 ** (1 / 3)


@pytest.mark.parametrize(
    ("loss_type", "exp_loss", "exp_grad0"),
    [
        ("grpo", -0.7447142425533319, -2 * R0 / 6),
        ("dapo", -1.0536570910639984, -2 * R0 / 5),
    ],
)
def test_sequence_level_literal(loss_type, exp_loss, exp_grad0):
    loss, grad, metrics = run(loss_type, ratios=GSPO_RATIOS, importance_sampling_level="sequence")
    assert loss == pytest.approx(exp_loss, abs=1e-9)
    assert_grad(grad, [[exp_grad0] * 3, [0.0] * 3])
    assert_metrics(metrics, GSPO_METRICS)


def test_sequence_level_high_clip():
    # row0 ratios all 1.5 -> r0 = 1.5 > 1.2 with A>0: clipped high; row1 [0.9, 0.9] -> r1 = 0.9 unclipped.
    # bnpo: (3*(-2.4) + 2*0.9)/5 = -1.08; grad row0 0; row1: each of its 2 token losses -A r1 moves by
    # -A r1 / 2 per d logp_t, so d/dlogp_t = 2 * 0.9/2 / 5 = 0.18. metrics: high = [1, 0] -> 0.5, high_max 1.
    loss, grad, metrics = run("bnpo", ratios=[[1.5] * 3, [0.9, 0.9, 7.0]], importance_sampling_level="sequence")
    assert loss == pytest.approx(-1.08, abs=1e-9)
    assert_grad(grad, [[0.0] * 3, [0.18, 0.18, 0.0]])
    assert_metrics(
        metrics,
        {
            "clip_ratio/low_mean": 0.0,
            "clip_ratio/high_mean": 0.5,
            "clip_ratio/region_mean": 0.5,
            "clip_ratio/low_min": 0.0,
            "clip_ratio/high_max": 1.0,
        },
    )


# ---- epsilon_high (asymmetric), delta (two-sided) -------------------------------------------------------------
ASYM_RATIOS = [[1.25, 1.5, 0.75], [0.75, 1.25, 1.0]]


def test_epsilon_high_asymmetric():
    # epsilon=0.2, epsilon_high=0.28: range [0.8, 1.28].
    # row0 (A=2):  1.25 -> -2.5 (not clipped; it would be with 1.2), 1.5 -> -2*1.28 = -2.56 (high), 0.75 -> -1.5
    # row1 (A=-1): 0.75 -> max(0.75, 0.8) = 0.8 (low), 1.25 -> 1.25          sum = -6.56 + 2.05 = -4.51
    # dapo: -4.51/5 = -0.902; grad /5: (0,0) -2*1.25 -> -0.5, (0,1) 0, (0,2) -2*0.75 -> -0.3, (1,0) 0, (1,1) 0.25
    loss, grad, metrics = run("dapo", ratios=ASYM_RATIOS, epsilon_high=0.28)
    assert loss == pytest.approx(-0.902, abs=1e-9)
    assert_grad(grad, [[-0.5, 0.0, -0.3], [0.0, 0.25, 0.0]])
    assert_metrics(
        metrics,
        {
            "clip_ratio/low_mean": 0.2,
            "clip_ratio/high_mean": 0.2,
            "clip_ratio/region_mean": 0.4,
            "clip_ratio/low_min": 0.0,
            "clip_ratio/high_max": 1 / 3,
        },
    )
    # symmetric (epsilon_high None -> 0.2): 1.25 is now clipped too: row0 -2.4 -2.4 -1.5, sum -4.25 -> -0.85
    loss, grad, metrics = run("dapo", ratios=ASYM_RATIOS)
    assert loss == pytest.approx(-0.85, abs=1e-9)
    assert_grad(grad, [[0.0, 0.0, -0.3], [0.0, 0.25, 0.0]])
    assert metrics["clip_ratio/high_mean"] == pytest.approx(0.4, rel=1e-6)
    assert metrics["clip_ratio/high_max"] == pytest.approx(2 / 3, rel=1e-6)


def test_epsilon_low_differs_from_high():
    # epsilon=0.3 (low bound 0.7), epsilon_high=0.2: row1 r=0.75 is no longer clipped low: max(0.75, 0.75) = 0.75.
    # row0: 1.25 -> 1.2 (-2.4), 1.5 -> 1.2 (-2.4), 0.75 -> -1.5; row1: 0.75 + 1.25 = 2.0 -> (-6.3 + 2.0)/5 = -0.86
    loss, grad, metrics = run("dapo", ratios=ASYM_RATIOS, epsilon=0.3, epsilon_high=0.2)
    assert loss == pytest.approx(-0.86, abs=1e-9)
    assert_grad(grad, [[0.0, 0.0, -0.3], [0.75 / 5, 0.25, 0.0]])
    assert metrics["clip_ratio/low_mean"] == 0.0


def test_delta_caps_unclipped_ratio():
    # delta=1.3: r <- min(r, 1.3) in the unclipped branch only (the clipped branch still uses clip(raw r)).
    # row0 (A=2): r=1.5: -2*min(1.3, 1.2) = -2.4 (grad 0), 0.5 -> -1.0, 1.1 -> -2.2
    # row1 (A=-1): r=1.5: max(1.3, 1.2) = 1.3 (was 1.5; r above delta, grad 0), 0.5 -> 0.8
    # bnpo: (-5.6 + 2.1)/5 = -0.7; grad /5: [[0, -0.2, -0.44], [0, 0, 0]]
    loss, grad, metrics = run("bnpo", ratios=RATIOS, delta=1.3)
    assert loss == pytest.approx(-0.7, abs=1e-9)
    assert_grad(grad, [[0.0, -0.2, -0.44], [0.0, 0.0, 0.0]])
    assert_metrics(metrics, OFF_CLIP_METRICS)  # min(1.5, 1.3) = 1.3 > 1.2 still counts as high


def test_delta_clip_metrics_use_delta_clamped_ratio():
    # delta=1.05 (below 1+epsilon_high): r_d = min(r, 1.05)
    # row0 (A=2): min(1.05, 1.2) -> -2.1; min(0.5, 0.8) -> -1.0; min(1.05, 1.1) -> -2.1
    # row1 (A=-1): max(1.05, 1.2) = 1.2; max(0.5, 0.8) = 0.8              bnpo = (-5.2 + 2.0)/5 = -0.64
    # only (0,1) has a live gradient: -2*0.5/5 = -0.2
    # metrics use r_d: high needs r_d > 1.2 -> none (raw r=1.5 would count); low: (1,1) -> 1/5
    loss, grad, metrics = run("bnpo", ratios=RATIOS, delta=1.05)
    assert loss == pytest.approx(-0.64, abs=1e-9)
    assert_grad(grad, [[0.0, -0.2, 0.0], [0.0, 0.0, 0.0]])
    assert_metrics(
        metrics,
        {
            "clip_ratio/low_mean": 0.2,
            "clip_ratio/high_mean": 0.0,
            "clip_ratio/region_mean": 0.2,
            "clip_ratio/low_min": 0.0,
            "clip_ratio/high_max": 0.0,
        },
    )


# ---- KL (beta > 0), bias correction, entropy mask -------------------------------------------------------------
# ref = logp + d, k3: kl = e^d - d - 1;  d = ln2 -> 1 - ln2 = 0.306853;  d = 0 -> 0;  d = -ln2 -> ln2 - 0.5 = 0.193147
# d kl / d logp = 1 - e^d: ln2 -> -1, 0 -> 0, -ln2 -> 0.5.  Padding gets d=5 (must be ignored).
REF_OFFSETS = [[LN2, 0.0, -LN2], [-LN2, LN2, 5.0]]
# masked mean of kl = (0.306853 + 0 + 0.193147 + 0.193147 + 0.306853)/5 = 1.0/5 = 0.2


def test_kl_k3_values():
    logps = t64([0.0, 0.0, 0.0, -1.0])
    ref = t64([LN2, 0.0, -LN2, -1.0])
    torch.testing.assert_close(kl_k3(logps, ref), t64([1 - LN2, 0.0, LN2 - 0.5, 0.0]))


def test_beta_kl_on_policy_dapo():
    # without the bias correction (use_bias_correction_kl=False; the True default is tested below)
    # loss = -0.8 + 0.04 * 1.0/5 = -0.792
    # grad = (-A + 0.04 (1 - e^d)) m / 5: row0 (-2.04, -2, -1.98)/5, row1 (1.02, 0.96)/5
    loss, grad, metrics = run("dapo", beta=0.04, ref_offsets=REF_OFFSETS, use_bias_correction_kl=False)
    assert loss == pytest.approx(-0.792, abs=1e-12)
    assert_grad(grad, [[-0.408, -0.4, -0.396], [0.204, 0.192, 0.0]])
    assert set(metrics) == CLIP_KEYS | {"kl"}
    assert metrics["kl"] == pytest.approx(0.2, rel=1e-6)


def test_beta_kl_on_policy_gradient_with_and_without_bias_correction():
    # On-policy the ratio r = exp(logp - sg(logp)) is 1, but d r / d logp = 1. With d = ref - logp:
    #   kl = e^d - d - 1                  row0 (1 - ln2, 0, ln2 - 1/2), row1 (ln2 - 1/2, 1 - ln2)
    #   d kl / d logp = 1 - e^d           row0 (-1, 0, 1/2),           row1 (1/2, -1)
    # without the correction:  grad = (-A + 0.04 dkl) m / 5
    # with it (kl * r):        grad = (-A + 0.04 (dkl r + kl dr/dlogp)) m / 5 = (-A + 0.04 (dkl + kl)) m / 5,
    #   where dkl + kl = row0 (-ln2, 0, ln2), row1 (ln2, -ln2)
    # The loss value and the kl metric are the same either way (r = 1): -0.8 + 0.04 * 1/5 and 1/5.
    def expected(kl_grad):
        return [[(-a + 0.04 * g) * m / 5 for g, m in zip(gs, ms)] for a, gs, ms in zip(ADV, kl_grad, MASK)]

    without = expected([[-1.0, 0.0, 0.5], [0.5, -1.0, 0.0]])  # the test above's numbers
    with_correction = expected([[-LN2, 0.0, LN2], [LN2, -LN2, 0.0]])  # row0 -0.405545, -0.4, -0.394455
    for correction, want in ((False, without), (True, with_correction)):
        loss, grad, metrics = run("dapo", beta=0.04, ref_offsets=REF_OFFSETS, use_bias_correction_kl=correction)
        assert_grad(grad, want)
        assert loss == pytest.approx(-0.792, abs=1e-12)
        assert metrics["kl"] == pytest.approx(0.2, rel=1e-6)
    assert with_correction[0][0] == pytest.approx((-2 - 0.04 * LN2) / 5)
    # the default, of LossParams and of GRPOConfig, is True (TRL 1.16)
    assert LossParams().use_bias_correction_kl and make_cfg().use_bias_correction_kl
    assert_grad(run("dapo", beta=0.04, ref_offsets=REF_OFFSETS)[1], with_correction)


def test_beta_kl_grpo_sequence_mean():
    # grpo: per token -A + 0.04 kl; row0 mean (-6 + 0.04*0.5)/3, row1 mean (2 + 0.04*0.5)/2
    # loss = ((-5.98/3) + (2.02/2))/2 = -0.491667 (on-policy, so the same with or without the bias correction)
    loss, _, _ = run("grpo", beta=0.04, ref_offsets=REF_OFFSETS)
    assert loss == pytest.approx(((-5.98 / 3) + (2.02 / 2)) / 2, abs=1e-12)


def test_beta_needs_ref_logps():
    with pytest.raises(ValueError):
        run("dapo", beta=0.04)


def test_kl_not_affected_by_entropy_mask():
    # entropy mask drops (0,1) and (1,0) from the policy term only.
    # dapo: policy sum = -2 -2 (row0 tokens 0,2) + 1 (row1 token 1) = -3 -> -0.6; KL unchanged: + 0.008 -> -0.592
    # grad: (0,1) -> 0.04*0/5 = 0; (1,0) -> 0.04*0.5/5 = 0.004 (KL still acts); others as without the mask
    # (gradients without the bias correction: use_bias_correction_kl=False)
    em = [[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]
    loss, grad, metrics = run("dapo", beta=0.04, ref_offsets=REF_OFFSETS, entropy_mask=em, use_bias_correction_kl=False)
    assert loss == pytest.approx(-0.592, abs=1e-12)
    assert_grad(grad, [[-0.408, 0.0, -0.396], [0.004, 0.192, 0.0]])
    assert metrics["kl"] == pytest.approx(0.2, rel=1e-6)
    # with it (the default), the KL gradient is 0.04 (dkl + kl) / 5 (see the test above): (0,1) still 0, (1,0)
    # 0.04 ln2 / 5; the loss is the same (r = 1)
    loss, grad, _ = run("dapo", beta=0.04, ref_offsets=REF_OFFSETS, entropy_mask=em, use_bias_correction_kl=True)
    assert loss == pytest.approx(-0.592, abs=1e-12)
    assert_grad(
        grad, [[(-2 - 0.04 * LN2) / 5, 0.0, (-2 + 0.04 * LN2) / 5], [0.04 * LN2 / 5, (1 - 0.04 * LN2) / 5, 0.0]]
    )


def test_entropy_mask_only_policy_term_and_normalizers_unchanged():
    # grpo with the entropy mask: the dropped tokens still count in |o_i|: row0 -4/3, row1 1/2 -> mean -0.416667
    em = [[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]
    loss, grad, _ = run("grpo", entropy_mask=em)
    assert loss == pytest.approx((-4 / 3 + 0.5) / 2, abs=1e-12)
    assert_grad(grad, [[-1 / 3, 0.0, -1 / 3], [0.0, 0.25, 0.0]])
    # dapo: N stays 5 (default = active tokens): (-4 + 1)/5 = -0.6
    assert run("dapo", entropy_mask=em)[0] == pytest.approx(-0.6, abs=1e-12)
    # a boolean entropy mask works the same
    lp = torch.tensor(LOGPS, dtype=F64, requires_grad=True)
    loss_b, _ = policy_loss(lp, None, t64(ADV), t64(MASK), make_cfg("dapo"), entropy_mask=torch.tensor(em).bool())
    assert loss_b.item() == pytest.approx(-0.6, abs=1e-12)


def test_bias_correction_kl():
    # kl <- kl * r (r not detached), RATIOS: masked mean of kl*r =
    #   (0.306853*1.5 + 0*0.5 + 0.193147*1.1 + 0.193147*1.5 + 0.306853*0.5)/5 = 0.223178
    # bnpo: -0.66 + 0.04 * 0.223178 = -0.651073
    # grad = [policy grad + 0.04 ((1 - e^d) r + kl r)] / 5
    loss, grad, metrics = run("bnpo", ratios=RATIOS, beta=0.04, ref_offsets=REF_OFFSETS, use_bias_correction_kl=True)
    assert metrics["kl"] == pytest.approx(0.22317766166719344, rel=1e-6)
    assert loss == pytest.approx(-0.6510728935333123, abs=1e-12)
    assert_grad(
        grad, [[-0.008317766166719346, -0.2, -0.4339003048110725], [0.30831776616671935, -0.0027725887222397817, 0.0]]
    )
    # without the correction the ratios do not touch the KL term: kl metric 0.2, loss -0.66 + 0.008
    loss, _, metrics = run("bnpo", ratios=RATIOS, beta=0.04, ref_offsets=REF_OFFSETS, use_bias_correction_kl=False)
    assert metrics["kl"] == pytest.approx(0.2, rel=1e-6)
    assert loss == pytest.approx(-0.652, abs=1e-12)


def test_bias_correction_kl_sequence_level():
    # sequence level: kl_t * r_i with r_i = exp(masked mean log ratio); GSPO_RATIOS -> r0 = 1.5^(1/3), r1 = 0.5
    # kl mean = (r0 * 0.5 + 0.5 * 0.5)/5   (row0 kl sum 0.5, row1 kl sum 0.5)
    _, _, metrics = run(
        "grpo",
        ratios=GSPO_RATIOS,
        beta=0.04,
        ref_offsets=REF_OFFSETS,
        use_bias_correction_kl=True,
        importance_sampling_level="sequence",
    )
    assert metrics["kl"] == pytest.approx((R0 * 0.5 + 0.5 * 0.5) / 5, rel=1e-6)


def test_high_entropy_mask_quantiles():
    f32 = torch.float32  # entropies come out of the forward pass in float32
    ent = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 5.0]], dtype=f32)  # 5.0 is padding
    mask = torch.tensor(MASK, dtype=f32)
    active = torch.tensor([0.1, 0.5, 0.9, 0.3, 0.7], dtype=f32)
    # rho = 0.4: thr = quantile(active, 0.6) = 0.5 + 0.4*(0.7-0.5) = 0.58 -> keeps 0.9 and 0.7
    out = high_entropy_mask(ent, mask, active, 0.4)
    assert out.dtype == torch.bool
    assert out.tolist() == [[False, False, True], [False, True, False]]
    # rho = 0 keeps only the maximum; rho = 1 keeps every active token (never padding)
    assert high_entropy_mask(ent, mask, active, 0.0).tolist() == [[False, False, True], [False, False, False]]
    assert high_entropy_mask(ent, mask, active, 1.0).tolist() == [[True, True, True], [True, True, False]]
    # the threshold comes from all_entropies (e.g. all processes), not only the local tokens: thr 0.975
    assert high_entropy_mask(ent, mask, torch.tensor([0.95, 1.0]), 0.5).tolist() == [[False] * 3, [False] * 3]
    # nothing gathered -> all false
    assert not high_entropy_mask(ent, mask, torch.tensor([]), 0.5).any()
    # ties at the maximum are all kept with rho = 0
    ent2 = torch.tensor([[0.9, 0.9, 0.1], [0.2, 0.3, 0.0]], dtype=f32)
    all2 = torch.tensor([0.9, 0.9, 0.1, 0.2, 0.3], dtype=f32)
    assert high_entropy_mask(ent2, mask, all2, 0.0).tolist() == [[True, True, False], [False, False, False]]
    # a zero-entropy active token makes the threshold 0 at rho = 1: padding (H*m = 0 >= 0) must still be dropped
    ent3 = torch.tensor([[0.0, 0.5, 0.9], [0.3, 0.7, 5.0]], dtype=f32)
    all3 = torch.tensor([0.0, 0.5, 0.9, 0.3, 0.7], dtype=f32)
    assert high_entropy_mask(ent3, mask, all3, 1.0).tolist() == [[True, True, True], [True, True, False]]


def test_entropy_bonus():
    ent = t64([[0.1, 0.5, 0.9], [0.3, 0.7, 5.0]])
    assert entropy_bonus(ent, t64(MASK)).item() == pytest.approx(0.5, abs=1e-12)  # (0.1+0.5+0.9+0.3+0.7)/5
    assert entropy_bonus(ent, torch.zeros(2, 3)).item() == 0.0


# ---- slow reference implementation (spec §2.3-2.7, §8), loops over rows and tokens -------------------------------


def reference_policy_loss(
    logps, old_logps, advantages, mask, args, ref_logps=None, num_items_in_batch=None, entropy_mask=None
):
    B, T = logps.shape
    old = logps.detach() if old_logps is None else old_logps
    lt = args.loss_type
    eps_low, eps_high = args.epsilon, args.epsilon_high
    seq_level = args.importance_sampling_level == "sequence"
    m = [[float(mask[i, t]) for t in range(T)] for i in range(B)]
    lengths = [sum(row) for row in m]
    total_tokens = sum(lengths)
    N = max(total_tokens, 1.0) if num_items_in_batch is None else float(num_items_in_batch)

    per_token = [[None] * T for _ in range(B)]
    kl_vals = [[None] * T for _ in range(B)]
    low_ind = [[0.0] * T for _ in range(B)]
    high_ind = [[0.0] * T for _ in range(B)]
    cispo_ind = [[0.0] * T for _ in range(B)]
    phis = []
    for i in range(B):
        a = float(advantages[i])
        if seq_level:
            s = sum((logps[i, t] - old[i, t]) * m[i][t] for t in range(T))
            seq_ratio = torch.exp(s / max(lengths[i], 1.0))
        if lt == "vespo":  # sum of clamped token log ratios, no gradient
            s = sum(m[i][t] * min(max((logps[i, t] - old[i, t]).item(), -20.0), 20.0) for t in range(T))
            log_w = min(max(s, math.log(1e-8)), 20.0)
            k, lam = (args.vespo_k_pos, args.vespo_lambda_pos) if a >= 0 else (args.vespo_k_neg, args.vespo_lambda_neg)
            lam = max(lam, 1e-4)
            try:
                phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
            except OverflowError:
                phi = 0.0
            if not math.isfinite(phi):
                phi = 0.0
            phis.append(phi)
        for t in range(T):
            r = seq_ratio if seq_level else torch.exp(logps[i, t] - old[i, t])
            if lt in CLIPPED:
                r_clip = torch.clamp(r, 1 - eps_low, 1 + eps_high)
                r_unclip = torch.clamp(r, max=args.delta) if args.delta is not None else r
                loss_t = -torch.minimum(r_unclip * a, r_clip * a)
                low_ind[i][t] = float(r_unclip.item() < 1 - eps_low and a < 0)
                high_ind[i][t] = float(r_unclip.item() > 1 + eps_high and a > 0)
            elif lt == "cispo":
                c = min(r.item(), eps_high)  # a constant: no gradient through the cap
                loss_t = -c * a * logps[i, t]
                cispo_ind[i][t] = float(r.item() > eps_high and a > 0)
            elif lt == "sapo":
                tau = args.sapo_temperature_pos if a > 0 else args.sapo_temperature_neg
                loss_t = -(4 / tau) * torch.sigmoid(tau * (r - 1)) * a
            elif lt == "vespo":
                loss_t = -phis[i] * a * logps[i, t]
            if entropy_mask is not None:
                loss_t = loss_t * float(entropy_mask[i, t])
            if args.beta != 0.0:
                d = ref_logps[i, t] - logps[i, t]
                kl = torch.exp(d) - d - 1
                if args.use_bias_correction_kl:
                    kl = kl * r
                kl_vals[i][t] = kl
                loss_t = loss_t + args.beta * kl
            per_token[i][t] = loss_t

    row_sums = [sum(per_token[i][t] * m[i][t] for t in range(T)) for i in range(B)]
    if lt in ("grpo", "sapo"):
        loss = sum(row_sums[i] / max(lengths[i], 1.0) for i in range(B)) / B
    elif lt == "bnpo":
        loss = sum(row_sums) / max(total_tokens, 1.0)
    elif lt == "dr_grpo":
        loss = sum(row_sums) / (B * args.max_completion_length)
    elif lt in ("dapo", "cispo", "vespo"):
        loss = sum(row_sums) / N
    elif lt == "luspo":
        loss = sum(row_sums) / B

    def token_mean(ind):
        return sum(ind[i][t] * m[i][t] for i in range(B) for t in range(T)) / max(total_tokens, 1.0)

    metrics = {}
    if lt in CLIPPED:
        region = [[float(low_ind[i][t] or high_ind[i][t]) for t in range(T)] for i in range(B)]
        if seq_level:  # one value per sequence, every sequence counts
            low_seq = [low_ind[i][0] for i in range(B)]
            high_seq = [high_ind[i][0] for i in range(B)]
            metrics["clip_ratio/low_mean"] = sum(low_seq) / B
            metrics["clip_ratio/high_mean"] = sum(high_seq) / B
            metrics["clip_ratio/region_mean"] = sum(region[i][0] for i in range(B)) / B
        else:  # per-sequence fractions over active tokens; rows without tokens are skipped
            low_seq = [sum(low_ind[i][t] * m[i][t] for t in range(T)) / lengths[i] for i in range(B) if lengths[i]]
            high_seq = [sum(high_ind[i][t] * m[i][t] for t in range(T)) / lengths[i] for i in range(B) if lengths[i]]
            metrics["clip_ratio/low_mean"] = token_mean(low_ind)
            metrics["clip_ratio/high_mean"] = token_mean(high_ind)
            metrics["clip_ratio/region_mean"] = token_mean(region)
        metrics["clip_ratio/low_min"] = min(low_seq) if low_seq else float("nan")
        metrics["clip_ratio/high_max"] = max(high_seq) if high_seq else float("nan")
    elif lt == "cispo":
        if seq_level:
            metrics["cispo_clip_ratio"] = sum(cispo_ind[i][0] for i in range(B)) / B
        else:
            metrics["cispo_clip_ratio"] = token_mean(cispo_ind)
    elif lt == "vespo":
        metrics["vespo/phi_seq_mean"] = sum(phis) / B
    if args.beta != 0.0:
        metrics["kl"] = sum(kl_vals[i][t].item() * m[i][t] for i in range(B) for t in range(T)) / max(total_tokens, 1)
    return loss, metrics


def random_batch(seed, B=5, T=6, lengths=(6, 3, 0, 1, 5), off_scale=0.4):
    g = torch.Generator().manual_seed(seed)
    logps = (-3 * torch.rand(B, T, generator=g, dtype=F64)).requires_grad_(True)
    mask = torch.zeros(B, T, dtype=F64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    adv = torch.randn(B, generator=g, dtype=F64)
    adv[3] = 0.0
    old = logps.detach() + off_scale * torch.randn(B, T, generator=g, dtype=F64)
    ref = logps.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    ent_mask = (torch.rand(B, T, generator=g) > 0.3).to(F64)
    return logps, old, adv, mask, ref, ent_mask


def compare_with_reference(cfg, seed, use_old, entropy_mask=False, num_items=None):
    logps, old, adv, mask, ref, ent_mask = random_batch(seed)
    old = old if use_old else None
    ref = ref if cfg.beta != 0.0 else None
    em = ent_mask if entropy_mask else None
    loss, metrics = policy_loss(
        logps, old, adv, mask, cfg, ref_logps=ref, num_items_in_batch=num_items, entropy_mask=em
    )
    (grad,) = torch.autograd.grad(loss, logps)
    exp_loss, exp_metrics = reference_policy_loss(logps, old, adv, mask, cfg, ref, num_items, em)
    (exp_grad,) = torch.autograd.grad(exp_loss, logps)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.allclose(loss, exp_loss, rtol=1e-6, atol=1e-9), (loss.item(), exp_loss.item())
    assert torch.allclose(grad, exp_grad, rtol=1e-6, atol=1e-9)
    assert grad[2].abs().sum() == 0  # the fully masked row gets no gradient
    assert set(metrics) == set(exp_metrics)
    for key, value in exp_metrics.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6, nan_ok=True), key
    return exp_metrics


@pytest.mark.parametrize("use_old", [False, True], ids=["on_policy", "off_policy"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_reference(loss_type, level, beta, use_old):
    cfg = make_cfg(loss_type, importance_sampling_level=level, beta=beta, max_completion_length=8)
    for seed in (0, 1):
        compare_with_reference(cfg, seed, use_old)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_matches_reference_all_options(loss_type, level):
    cfg = make_cfg(
        loss_type,
        importance_sampling_level=level,
        beta=0.04,
        use_bias_correction_kl=True,
        epsilon=0.1,
        epsilon_high=1.1 if loss_type == "cispo" else 0.3,
        delta=1.4,
        sapo_temperature_pos=0.7,
        sapo_temperature_neg=1.3,
        vespo_k_pos=1.5,
        vespo_lambda_pos=2.5,
        vespo_k_neg=2.5,
        vespo_lambda_neg=1.5,
        max_completion_length=8,
    )
    for seed in (2, 3):
        compare_with_reference(cfg, seed, use_old=True, entropy_mask=True, num_items=37.0)


def test_reference_comparison_exercises_clipping():
    # guard: the random off-policy inputs really hit both clip sides, else the comparison above is weak
    cfg = make_cfg("dapo", max_completion_length=8)
    metrics = compare_with_reference(cfg, 0, use_old=True)
    assert metrics["clip_ratio/low_mean"] > 0 or metrics["clip_ratio/high_mean"] > 0
    seen_low = seen_high = False
    for seed in (0, 1, 2, 3):
        metrics = compare_with_reference(cfg, seed, use_old=True)
        seen_low |= metrics["clip_ratio/low_mean"] > 0
        seen_high |= metrics["clip_ratio/high_mean"] > 0
    assert seen_low and seen_high


# ---- gradient accumulation -------------------------------------------------------------------------------------


def ga_batch(seed=7, B=8, T=7):
    g = torch.Generator().manual_seed(seed)
    logps = (-3 * torch.rand(B, T, generator=g, dtype=F64)).requires_grad_(True)
    lengths = [7, 2, 5, 0, 3, 7, 1, 4]
    mask = torch.zeros(B, T, dtype=F64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    adv = torch.randn(B, generator=g, dtype=F64)
    old = logps.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    ref = logps.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    return logps, old, adv, mask, ref


@pytest.mark.parametrize("loss_type", ["dapo", "cispo", "vespo"])
@pytest.mark.parametrize("num_micro", [2, 4])
def test_grad_accumulation_token_sum(loss_type, num_micro):
    # each micro-batch divides by N = active tokens of the whole batch; summed gradients equal one full call
    logps, old, adv, mask, ref = ga_batch()
    cfg = make_cfg(loss_type, beta=0.04, epsilon_high=1.1 if loss_type == "cispo" else None)
    n_total = mask.sum()  # 29
    assert n_total.item() == 29.0
    full, _ = policy_loss(logps, old, adv, mask, cfg, ref, num_items_in_batch=n_total)
    (full_grad,) = torch.autograd.grad(full, logps)
    total_loss = 0.0
    total_grad = torch.zeros_like(logps)
    for rows in torch.arange(8).chunk(num_micro):
        loss, _ = policy_loss(logps[rows], old[rows], adv[rows], mask[rows], cfg, ref[rows], num_items_in_batch=n_total)
        total_grad += torch.autograd.grad(loss, logps)[0]
        total_loss += loss.item()
    assert total_loss == pytest.approx(full.item(), abs=1e-12)
    assert torch.allclose(total_grad, full_grad, rtol=1e-10, atol=1e-14)
    # contrast: normalizing by each micro-batch's own token count (the default) is not the batch token mean
    local = torch.zeros_like(logps)
    for rows in torch.arange(8).chunk(num_micro):
        loss, _ = policy_loss(logps[rows], old[rows], adv[rows], mask[rows], cfg, ref[rows])
        local += torch.autograd.grad(loss, logps)[0] / num_micro
    assert not torch.allclose(local, full_grad)


@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "dr_grpo", "luspo"])
@pytest.mark.parametrize("num_micro", [2, 4])
def test_grad_accumulation_divided_by_ga(loss_type, num_micro):
    # equal row counts per micro-batch: sum_k loss_k / GA equals the full-batch loss (and so do the gradients)
    logps, old, adv, mask, ref = ga_batch()
    cfg = make_cfg(loss_type, beta=0.04, max_completion_length=7)
    full, _ = policy_loss(logps, old, adv, mask, cfg, ref)
    (full_grad,) = torch.autograd.grad(full, logps)
    total = 0.0
    total_grad = torch.zeros_like(logps)
    for rows in torch.arange(8).chunk(num_micro):
        loss, _ = policy_loss(logps[rows], old[rows], adv[rows], mask[rows], cfg, ref[rows])
        loss = loss / num_micro
        total_grad += torch.autograd.grad(loss, logps)[0]
        total += loss.item()
    assert total == pytest.approx(full.item(), abs=1e-12)
    assert torch.allclose(total_grad, full_grad, rtol=1e-10, atol=1e-14)


# ---- fully masked rows -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_fully_masked_rows(loss_type, level):
    logps, old, adv, mask, ref, _ = random_batch(5)
    cfg = make_cfg(loss_type, importance_sampling_level=level, beta=0.04, use_bias_correction_kl=True)
    # one row without tokens (row 2): finite loss, metrics and gradient, no gradient on that row
    loss, metrics = policy_loss(logps, old, adv, mask, cfg, ref)
    (grad,) = torch.autograd.grad(loss, logps)
    assert torch.isfinite(loss)
    assert torch.isfinite(grad).all()
    assert grad[2].abs().sum() == 0
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    # every row without tokens: loss exactly 0, zero gradient
    for old_logps in (old, None):
        loss, _ = policy_loss(logps, old_logps, adv, torch.zeros_like(mask), cfg, ref)
        (grad,) = torch.autograd.grad(loss, logps)
        assert loss.item() == 0.0
        assert not torch.isnan(loss)
        assert torch.equal(grad, torch.zeros_like(grad))


def test_the_configs_loss_types_are_the_loss_table():
    """`GRPOConfig` (config, below algo in the layers) names the loss types it accepts; the math's table
    (`algo.losses.LOSS_TYPES`) is what runs them: the two lists must be one."""
    from grpo.algo.losses import LOSS_TYPES as TABLE
    from grpo.config.grpo_fields import LOSS_TYPES as NAMES

    assert tuple(TABLE) == NAMES
