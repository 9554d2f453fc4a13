"""Tests for grpo.algo.advantages against the shared spec §3 (advantages) and §8 (reward metrics).

Rows k*G .. k*G+G-1 form one prompt's group; NaN in rewards_per_func means the function returned None.
A = (R - group mean) / (std + 1e-4); std is Bessel-corrected (n - 1) and NaN with fewer than 2 valid values.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo.algo.advantages import compute_advantages, nanstd

NAN = float("nan")
EPS = 1e-4


def adv(rewards, weights=None, G=2, scale="group", agg="sum_then_normalize"):
    rpf = torch.tensor(rewards, dtype=torch.float32)
    if rpf.dim() == 1:
        rpf = rpf.unsqueeze(1)
    w = torch.ones(rpf.shape[1]) if weights is None else torch.tensor(weights, dtype=torch.float32)
    return compute_advantages(rpf, w, G, scale, agg)


def close(actual: torch.Tensor, expected, tol=1e-5):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=tol, atol=tol, equal_nan=True)


# ---- nanstd ----------------------------------------------------------------------------------------------------


def test_nanstd():
    assert nanstd(torch.tensor([1.0, NAN, 3.0])).item() == pytest.approx(math.sqrt(2))  # mean 2, (1+1)/(2-1)
    assert nanstd(torch.tensor([1.0, 0.0, 0.0, 1.0])).item() == pytest.approx(math.sqrt(1 / 3))
    assert math.isnan(nanstd(torch.tensor([NAN, 2.0])).item())  # a single valid value
    assert math.isnan(nanstd(torch.tensor([NAN, NAN])).item())
    x = torch.tensor([[1.0, 3.0, NAN], [NAN, NAN, 4.0], [2.0, 2.0, 2.0]])
    close(nanstd(x, dim=1), [math.sqrt(2), NAN, 0.0])
    assert nanstd(x, dim=1, keepdim=True).shape == (3, 1)
    close(nanstd(x, dim=0), [math.sqrt(0.5), math.sqrt(0.5), math.sqrt(2)])


# ---- literal values ------------------------------------------------------------------------------------------


def test_group_of_four_literal():
    # G=4, R = [1, 0, 0, 1]: mean 0.5, std = sqrt((4 * 0.25)/3) = 0.577350 -> A = +-0.5/(0.577350 + 1e-4)
    out = adv([1.0, 0.0, 0.0, 1.0], G=4)
    a = 0.5 / (math.sqrt(1 / 3) + EPS)  # 0.8658754
    close(out.advantages, [a, -a, -a, a])
    assert a == pytest.approx(0.8658754297607016)
    close(out.std, [0.5773502691896258] * 4)
    close(out.rewards, [1.0, 0.0, 0.0, 1.0])
    assert out.frac_zero_std == 0.0


TWO_GROUPS = [1.0, 0.0, 0.0, 1.0, 3.0, 5.0, 3.0, 5.0]  # group means 0.5 and 4


def test_scale_group_two_groups():
    # group 2: std = sqrt(4/3) = 1.154701 -> A = +-1/(1.154701 + 1e-4) = +-0.865950
    out = adv(TWO_GROUPS, G=4)
    a, b = 0.8658754297607016, 0.8659504102790668
    close(out.advantages, [a, -a, -a, a, -b, b, -b, b])
    close(out.std, [0.5773502691896258] * 4 + [1.1547005383792515] * 4)


def test_scale_batch_uses_group_mean_and_batch_std():
    # batch std of all 8 rewards: mean 2.25, sum of squares 29.5, /7 -> std 2.052873
    # A = (R - group mean) / (2.052873 + 1e-4): +-0.5/2.052973 = 0.243549, +-1/2.052973 = 0.487099
    out = adv(TWO_GROUPS, G=4, scale="batch")
    a, b = 0.24354928639486126, 0.4870985727897225
    close(out.advantages, [a, -a, -a, a, -b, b, -b, b])
    close(out.std, [2.052872551885702] * 8)
    assert out.frac_zero_std == 0.0


def test_scale_none_is_r_minus_group_mean():
    out = adv(TWO_GROUPS, G=4, scale="none")
    close(out.advantages, [0.5, -0.5, -0.5, 0.5, -1.0, 1.0, -1.0, 1.0])
    assert out.frac_zero_std == 0.0


def test_all_equal_groups_zero_advantage_and_frac_zero_std():
    # G=2 groups [1, 1], [0, 1], [2, 2]: equal groups get A=0 (0/(0+1e-4)); 4 of 6 rows have std 0
    rewards = [1.0, 1.0, 0.0, 1.0, 2.0, 2.0]
    e = 0.5 / (math.sqrt(0.5) + EPS)  # 0.707007
    out = adv(rewards)
    close(out.advantages, [0.0, 0.0, -e, e, 0.0, 0.0])
    assert out.frac_zero_std == pytest.approx(4 / 6)
    out = adv(rewards, scale="none")  # "none" still reports the group std
    close(out.advantages, [0.0, 0.0, -0.5, 0.5, 0.0, 0.0])
    assert out.frac_zero_std == pytest.approx(4 / 6)
    # "batch": the std is the batch std (non-zero), so the metric is 0; equal groups still get A = 0
    out = adv(rewards, scale="batch")
    assert out.advantages[[0, 1, 4, 5]].abs().max().item() == 0.0
    assert out.frac_zero_std == 0.0
    # "batch" with every reward equal: the metric is 1
    out = adv([3.0] * 4, scale="batch")
    close(out.advantages, [0.0] * 4)
    assert out.frac_zero_std == 1.0


def test_reward_weights():
    # weights [2, -1]: R = [2*1 - 0, 0 - 1, 2 - 1, 0] = [2, -1, 1, 0]
    # group 1: mean 0.5, std sqrt(4.5) -> +-1.5/(2.121320 + 1e-4) = +-0.707073
    # group 2: mean 0.5, std sqrt(0.5) -> +-0.5/(0.707107 + 1e-4) = +-0.707007
    out = adv([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]], weights=[2.0, -1.0])
    close(out.rewards, [2.0, -1.0, 1.0, 0.0])
    a, b = 0.7070734494244885, 0.7070067953266834
    close(out.advantages, [a, -a, b, -b])


# ---- None (NaN) handling -------------------------------------------------------------------------------------


def test_none_rewards_literal():
    # weights [1, 0.5], G=4.
    # group 1: [1, 2] -> 2; [None, 4] -> 0.5*4 = 2 (None ignored); [3, None] -> 3; [None, None] -> unscorable (NaN)
    #   valid R = [2, 2, 3]: mean 7/3, std sqrt((1/9 + 1/9 + 4/9)/2) = 0.577350
    #   A = [-1/3, -1/3, 2/3]/(0.577350 + 1e-4), unscorable row -> 0
    # group 2: a single valid row (R=5): std NaN -> every advantage 0
    rewards = [[1.0, 2.0], [NAN, 4.0], [3.0, NAN], [NAN, NAN], [NAN, NAN], [5.0, NAN], [NAN, NAN], [NAN, NAN]]
    out = adv(rewards, weights=[1.0, 0.5], G=4)
    close(out.rewards, [2.0, 2.0, 3.0, NAN, NAN, 5.0, NAN, NAN])
    s = 0.5772502865071343  # (1/3)/(0.577350 + 1e-4)
    close(out.advantages, [-s, -s, 2 * s, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert not torch.isnan(out.advantages).any()
    assert out.frac_zero_std == 0.0  # a NaN std is not "zero std"


def test_all_none_row_gets_zero_advantage_in_every_mode():
    rewards = [[1.0, NAN], [NAN, NAN], [0.0, 2.0], [NAN, 1.0]]
    for scale in ("group", "batch", "none"):
        out = adv(rewards, scale=scale)
        assert out.advantages[1].item() == 0.0
        assert math.isnan(out.rewards[1].item())
        assert torch.isfinite(out.advantages).all()
    out = adv(rewards, agg="normalize_then_sum")
    assert out.advantages[1].item() == 0.0
    assert torch.isfinite(out.advantages).all()


def test_batch_mode_with_nan_rows():
    # R = [1, NaN, 0, 3]: batch std over valid [1, 0, 3] = sqrt(((1-4/3)^2 + (4/3)^2 + (5/3)^2)/2) = 1.527525
    # group 1 has one valid value: mean 1 -> A = 0; group 2: mean 1.5 -> A = -+1.5/(1.527525 + 1e-4)
    out = adv([1.0, NAN, 0.0, 3.0], scale="batch")
    s = math.sqrt(7 / 3)
    close(out.advantages, [0.0, 0.0, -1.5 / (s + EPS), 1.5 / (s + EPS)])
    close(out.std, [s] * 4)


# ---- normalize_then_sum (GDPO) -------------------------------------------------------------------------------
GDPO_REWARDS = [[1.0, 0.0], [0.0, 1.0], [1.0, 2.0], [1.0, 0.0]]
# per function, per group (G=2): z = (r - mean)/(std + 1e-4)
#   group 1: f1 [1, 0] -> +-c, f2 [0, 1] -> -+c, with c = 0.5/(sqrt(0.5) + 1e-4) = 0.707007
#   group 2: f1 [1, 1] -> 0, 0;  f2 [2, 0] -> +-d, with d = 1/(sqrt(2) + 1e-4) = 0.707057
C_Z, D_Z = 0.7070067953266834, 0.7070567847218314


def test_normalize_then_sum_literal():
    # weights [1, 1]: R = [0, 0, d, -d]; batch mean 0, std sqrt(2 d^2 / 3) = 0.577309
    # A = R / (0.577309 + 1e-4) = [0, 0, 1.224533, -1.224533]
    out = adv(GDPO_REWARDS, agg="normalize_then_sum")
    close(out.advantages, [0.0, 0.0, 1.2245327610984114, -1.2245327610984114])
    close(out.std, [0.5773094472471266] * 4)
    assert out.frac_zero_std == 0.0


def test_normalize_then_sum_weights_and_ignores_scale_rewards():
    # weights [1, 2]: R = [c - 2c, -c + 2c, 2d, -2d] = [-c, c, 2d, -2d]; mean 0, batch std 1.290885
    expected = [-0.5476491530420234, 0.5476491530420234, 1.095375749893908, -1.095375749893908]
    for scale in ("group", "batch", "none"):
        out = adv(GDPO_REWARDS, weights=[1.0, 2.0], scale=scale, agg="normalize_then_sum")
        close(out.advantages, expected)


def test_sum_then_normalize_differs_on_same_data():
    # R = [1, 1, 3, 1]: group 1 all equal -> 0; group 2 [3, 1] -> +-1/(sqrt(2) + 1e-4)
    out = adv(GDPO_REWARDS)
    close(out.advantages, [0.0, 0.0, D_Z, -D_Z])
    assert out.frac_zero_std == 0.5


def test_normalize_then_sum_all_equal():
    out = adv([[1.0, 2.0]] * 4, agg="normalize_then_sum")
    close(out.advantages, [0.0] * 4)
    assert out.frac_zero_std == 1.0  # refers to the batch std of the z-sum


def test_rewards_field_is_raw_weighted_sum_in_both_modes():
    # §8: `reward` / `reward_std` are the nanmean / nanstd of the weighted sum of the *raw* rewards (unscorable rows
    # excluded), whatever multi_objective_aggregation is. The trainer logs them from Advantages.rewards, which is
    # documented as the "weighted reward sum". Raw weighted sums here: [1, 1, 3, 1].
    for agg in ("sum_then_normalize", "normalize_then_sum"):
        out = adv(GDPO_REWARDS, agg=agg)
        close(out.rewards, [1.0, 1.0, 3.0, 1.0])


def test_normalize_then_sum_row_with_no_group_spread_is_still_scorable():
    # §3 GDPO: R_i = nansum_k w_k z_ik, and only rows where *every function returned None* are unscorable (NaN).
    # K=1, G=2: group 1 = [1, None]: row 0 is scorable but its z is NaN (one valid value -> std NaN), so nansum
    # gives R_0 = 0; row 1 is unscorable. group 2 = [0, 2] -> z = -+d'; group 3 = [5, 5] -> z = 0, 0.
    # Batch over R = [0, -d', d', 0, 0] (5 valid values): mean 0, std = sqrt(2 d'^2 / 4) = 0.499965
    # A = [0, 0, -1.413931, 1.413931, 0, 0]   (leaving row 0 out of the batch std would give +-1.224533)
    out = adv([1.0, NAN, 0.0, 2.0, 5.0, 5.0], agg="normalize_then_sum")
    close(out.advantages, [0.0, 0.0, -1.4139307562258492, 1.4139307562258492, 0.0, 0.0])
    close(out.std, [0.4999646471607639] * 6)


def test_single_completion_groups():
    # §3: with G=1 (eval with num_generations_eval=1) the std is 0, not NaN: advantages 0, every row zero-std.
    out = adv([1.0, 2.0, 3.0], G=1)
    close(out.advantages, [0.0, 0.0, 0.0])
    close(out.std, [0.0, 0.0, 0.0])
    assert out.frac_zero_std == 1.0


def test_rows_not_divisible_by_num_generations():
    with pytest.raises(ValueError):
        adv([1.0, 2.0, 3.0], G=2)


# ---- slow reference (spec §3), per-group python loops -------------------------------------------------------


def _valid(values):
    return [v for v in values if not math.isnan(v)]


def _nanmean(values):
    v = _valid(values)
    return sum(v) / len(v) if v else NAN


def _nanstd(values):
    v = _valid(values)
    if len(v) < 2:
        return NAN
    m = sum(v) / len(v)
    return math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))


def reference_advantages(rpf, weights, G, scale, agg):
    n, k = len(rpf), len(weights)
    unscorable = [all(math.isnan(x) for x in row) for row in rpf]
    groups = [list(range(s, s + G)) for s in range(0, n, G)]
    adv_out, std_out = [0.0] * n, [NAN] * n
    if agg == "sum_then_normalize":
        R = [
            NAN if unscorable[i] else sum(weights[j] * rpf[i][j] for j in range(k) if not math.isnan(rpf[i][j]))
            for i in range(n)
        ]
        batch_std = _nanstd(R)
        for rows in groups:
            mu = _nanmean([R[i] for i in rows])
            sigma = batch_std if scale == "batch" else _nanstd([R[i] for i in rows])
            for i in rows:
                a = R[i] - mu
                if scale != "none":
                    a = a / (sigma + EPS)
                adv_out[i] = 0.0 if math.isnan(a) else a
                std_out[i] = sigma
    else:
        z = [[NAN] * k for _ in range(n)]
        for rows in groups:
            for j in range(k):
                col = [rpf[i][j] for i in rows]
                mu, sigma = _nanmean(col), _nanstd(col)
                for i in rows:
                    z[i][j] = (rpf[i][j] - mu) / (sigma + EPS)
        R = [
            NAN if unscorable[i] else sum(weights[j] * z[i][j] for j in range(k) if not math.isnan(z[i][j]))
            for i in range(n)
        ]
        mu, sigma = _nanmean(R), _nanstd(R)
        for i in range(n):
            a = (R[i] - mu) / (sigma + EPS)
            adv_out[i] = 0.0 if math.isnan(a) else a
            std_out[i] = sigma
    frac = sum(1 for s in std_out if abs(s) <= 1e-8) / n  # torch.isclose(s, 0): |s| <= atol; NaN is not close
    return adv_out, R, std_out, frac


G_REF = 4


def random_rewards(seed, n_groups=6, K=3, gdpo_safe=False):
    G = G_REF
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, 4, (n_groups * G, K), generator=g).float() * 0.5  # coarse values: ties and equal groups
    nan = torch.rand(n_groups * G, K, generator=g) < 0.3
    if gdpo_safe:
        # function 0 has >= 2 valid values in every group, so no scorable row has an all-NaN z (that edge case is
        # test_normalize_then_sum_row_with_no_group_spread_is_still_scorable)
        nan[:, 0] = False
    r[nan] = NAN
    r[:G, :] = 1.0  # group 0: every reward equal
    r[G + 1, :] = NAN  # an unscorable row
    r[2 * G : 3 * G, :] = NAN  # a whole group of unscorable rows
    if not gdpo_safe:
        r[2 * G + 2, 0] = 2.0  # ... except one row: a single valid value -> NaN group std
    weights = torch.rand(K, generator=g) * 2 - 0.5  # some negative
    return r, weights


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    ("scale", "agg"),
    [
        ("group", "sum_then_normalize"),
        ("batch", "sum_then_normalize"),
        ("none", "sum_then_normalize"),
        ("group", "normalize_then_sum"),
    ],
)
def test_matches_reference(scale, agg, seed):
    gdpo = agg == "normalize_then_sum"
    r, w = random_rewards(seed, gdpo_safe=gdpo)
    out = compute_advantages(r.clone(), w.clone(), G_REF, scale, agg)
    exp_adv, exp_r, exp_std, exp_frac = reference_advantages(r.tolist(), w.tolist(), G_REF, scale, agg)
    close(out.advantages, exp_adv, tol=1e-4)
    close(out.std, exp_std, tol=1e-4)
    assert out.frac_zero_std == pytest.approx(exp_frac)
    assert torch.isfinite(out.advantages).all()
    assert any(a != 0 for a in exp_adv)
    if not gdpo:
        close(out.rewards, exp_r, tol=1e-5)
        if scale != "batch":  # the data covers an all-equal group and a NaN group std
            assert exp_frac > 0
            assert any(math.isnan(x) for x in exp_std)
