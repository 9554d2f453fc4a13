"""Tests for grpo.algo.sampling_correction (shared spec §4.2-4.3, TRL 1.16) and for how `policy_loss` applies the
sampling-mismatch weight rho and the off-policy sequence mask (spec §2.5-2.6).

Hand-worked batch (B=2, T=3; row 1's last token is padding, row 1's middle token was not scored by the engine):

    trainer  = [[-1.0, -2.0, -0.5],      sampling = [[-1.8, -2.3, -0.7],      mask = [[1, 1, 1],
                [-1.0, -1.5, -3.0]]                  [-0.1,  NaN, -8.0]]              [1, 1, 0]]

so d = trainer - sampling, masked, NaN -> 0, is [[0.8, 0.3, 0.2], [-0.9, 0, 0]]: token ratios
[[e^.8, e^.3, e^.2], [e^-.9, 1, 1]] and sequence ratios e^1.3 = 3.669 (row 0) and e^-.9 = 0.4066 (row 1).

A slow loop version of each function, written from the spec formulas, is compared with the vectorized one on
random inputs with NaN engine log-probs and padding.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from grpo.algo.losses import LOSS_TYPES, LossParams, Stat, policy_loss
from grpo.algo.sampling_correction import MODES, off_policy_mask, sampling_ratio, sampling_stats
from support.float64 import F64, t64

NAN = float("nan")
E = math.exp

TRAINER = [[-1.0, -2.0, -0.5], [-1.0, -1.5, -3.0]]
SAMPLING = [[-1.8, -2.3, -0.7], [-0.1, NAN, -8.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
CLIPS = [(None, None), (None, 3.0), (0.5, 2.0)]


def hand_ratio(mode, clip_min=None, clip_max=3.0):
    return sampling_ratio(t64(TRAINER), t64(SAMPLING), t64(MASK), mode, clip_min, clip_max)


def assert_values(x: torch.Tensor, expected) -> None:
    torch.testing.assert_close(x, t64(expected), rtol=1e-12, atol=1e-12)


# ---- slow references: loops over rows and tokens -------------------------------------------------------------


def reference_ratio(trainer, sampling, mask, mode, clip_min, clip_max):
    """(rho, outside) as nested lists, from spec §4.2."""
    B, T = trainer.shape
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    d = [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            x = (trainer[i, t].item() - sampling[i, t].item()) * mask[i, t].item()
            d[i][t] = 0.0 if math.isnan(x) else x
    logs = [[sum(row)] for row in d] if mode.startswith("sequence") else d
    rho = [[0.0] * len(row) for row in logs]
    outside = [[False] * len(row) for row in logs]
    for i, row in enumerate(logs):
        for t, x in enumerate(row):
            r = math.exp(x)
            outside[i][t] = r < low or r > high
            if mode.endswith("truncate"):
                rho[i][t] = min(max(r, low), high)
            else:
                rho[i][t] = 0.0 if outside[i][t] else r
    return rho, outside


def reference_stats(trainer, sampling, mask, rho, outside, sequence):
    B, T = trainer.shape
    diffs = []
    for i in range(B):
        for t in range(T):
            x = abs(trainer[i, t].item() - sampling[i, t].item())
            if mask[i, t] > 0 and not math.isnan(x):
                diffs.append(x)
    if sequence:
        ratios = [rho[i][0] for i in range(B)]
        flags = [outside[i][0] for i in range(B)]
    else:
        ratios = [rho[i][t] for i in range(B) for t in range(T) if mask[i, t] > 0]
        flags = [outside[i][t] for i in range(B) for t in range(T) if mask[i, t] > 0]
    return {
        "sampling/sampling_logp_difference/mean": sum(diffs) / max(len(diffs), 1),
        "sampling/sampling_logp_difference/max": max(diffs) if diffs else NAN,
        "sampling/importance_sampling_ratio/min": min(ratios) if ratios else NAN,
        "sampling/importance_sampling_ratio/mean": sum(ratios) / max(len(ratios), 1),
        "sampling/importance_sampling_ratio/max": max(ratios) if ratios else NAN,
        "sampling/importance_sampling_ratio/clipped_fraction": sum(flags) / max(len(flags), 1),
    }


def reference_opsm(advantages, logps, sampler, mask, threshold):
    B, T = logps.shape
    keep = []
    for i in range(B):
        total, count = 0.0, 0.0
        for t in range(T):
            x = sampler[i, t].item() - logps[i, t].item()
            total += mask[i, t].item() * (0.0 if math.isnan(x) else x)
            count += mask[i, t].item()
        kl = total / max(count, 1.0)
        keep.append([1.0 if advantages[i].item() >= 0 or kl <= threshold else 0.0])
    return keep


def random_batch(seed, B=6, T=7, lengths=(7, 4, 0, 1, 7, 5)):
    """Trainer and engine log-probs that disagree by up to ~1 nat per token (sequence ratios well outside
    [0.5, 3]), NaN engine log-probs on active and padded tokens, 0.0 on padding (a tool suffix)."""
    g = torch.Generator().manual_seed(seed)
    trainer = -3 * torch.rand(B, T, generator=g, dtype=F64)
    sampling = trainer + 0.4 * torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.zeros(B, T, dtype=F64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    sampling[mask == 0] = 0.0
    sampling[torch.rand(B, T, generator=g) < 0.2] = NAN
    return trainer, sampling, mask


# ---- sampling_ratio ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("seed", range(4))
def test_sampling_ratio_matches_reference(mode, clip, seed):
    trainer, sampling, mask = random_batch(seed)
    rho, outside = sampling_ratio(trainer, sampling, mask, mode, *clip)
    exp_rho, exp_outside = reference_ratio(trainer, sampling, mask, mode, *clip)
    assert rho.shape == ((6, 1) if mode.startswith("sequence") else (6, 7))
    torch.testing.assert_close(rho, t64(exp_rho), rtol=1e-12, atol=0.0)
    assert outside.dtype == torch.bool and outside.tolist() == exp_outside
    assert torch.isfinite(rho).all()


def test_the_random_batches_reach_every_branch():
    trainer, sampling, mask = random_batch(0)
    for mode in MODES:
        _, outside = sampling_ratio(trainer, sampling, mask, mode, 0.5, 2.0)
        assert outside.any() and not outside.all(), mode


# d = [[0.8, 0.3, 0.2], [-0.9, 0 (NaN engine log-prob), 0 (padding)]]
HAND = {
    (None, 3.0): {  # every token ratio is inside; row 0's product e^1.3 = 3.67 > 3
        "token_truncate": [[E(0.8), E(0.3), E(0.2)], [E(-0.9), 1.0, 1.0]],
        "token_mask": [[E(0.8), E(0.3), E(0.2)], [E(-0.9), 1.0, 1.0]],
        "sequence_truncate": [[3.0], [E(-0.9)]],  # clamped to C_max; row 1 keeps 0.4066 (not 1)
        "sequence_mask": [[0.0], [E(-0.9)]],  # zeroed; row 1 keeps its value
    },
    (0.5, 2.0): {  # e^.8 = 2.23 > 2 and e^-.9 = 0.41 < 0.5 fall outside, token and sequence
        "token_truncate": [[2.0, E(0.3), E(0.2)], [0.5, 1.0, 1.0]],
        "token_mask": [[0.0, E(0.3), E(0.2)], [0.0, 1.0, 1.0]],
        "sequence_truncate": [[2.0], [0.5]],
        "sequence_mask": [[0.0], [0.0]],
    },
    (None, None): {  # unbounded: the plain ratios, nothing outside
        "token_truncate": [[E(0.8), E(0.3), E(0.2)], [E(-0.9), 1.0, 1.0]],
        "token_mask": [[E(0.8), E(0.3), E(0.2)], [E(-0.9), 1.0, 1.0]],
        "sequence_truncate": [[E(1.3)], [E(-0.9)]],
        "sequence_mask": [[E(1.3)], [E(-0.9)]],
    },
}
HAND_OUTSIDE = {
    (None, 3.0): {"token": [[False] * 3, [False] * 3], "sequence": [[True], [False]]},
    (0.5, 2.0): {"token": [[True, False, False], [True, False, False]], "sequence": [[True], [True]]},
    (None, None): {"token": [[False] * 3, [False] * 3], "sequence": [[False], [False]]},
}


@pytest.mark.parametrize("clip", list(HAND))
@pytest.mark.parametrize("mode", MODES)
def test_sampling_ratio_hand_values(clip, mode):
    rho, outside = hand_ratio(mode, *clip)
    assert_values(rho, HAND[clip][mode])
    assert outside.tolist() == HAND_OUTSIDE[clip][mode.split("_")[0]]


def test_sampling_ratio_default_bounds_are_none_and_3():
    for mode in MODES:
        assert torch.equal(hand_ratio(mode)[0], hand_ratio(mode, None, 3.0)[0])


def test_sampling_ratio_is_a_constant():
    trainer = t64(TRAINER).requires_grad_(True)
    rho, outside = sampling_ratio(trainer, t64(SAMPLING), t64(MASK), "token_truncate")
    assert not rho.requires_grad and not outside.requires_grad


def test_sampling_ratio_unknown_mode_names_the_four():
    with pytest.raises(ValueError, match="token_truncate, token_mask, sequence_truncate, sequence_mask"):
        hand_ratio("sequence")


# ---- sampling_stats ---------------------------------------------------------------------------------------------


def stats_of(mode, clip, trainer=TRAINER, sampling=SAMPLING, mask=MASK):
    trainer, sampling, mask = t64(trainer), t64(sampling), t64(mask)
    rho, outside = sampling_ratio(trainer, sampling, mask, mode, *clip)
    return sampling_stats(trainer, sampling, mask, rho, outside)


STAT_KINDS = {
    "sampling/sampling_logp_difference/mean": "mean",
    "sampling/sampling_logp_difference/max": "max",
    "sampling/importance_sampling_ratio/min": "min",
    "sampling/importance_sampling_ratio/mean": "mean",
    "sampling/importance_sampling_ratio/max": "max",
    "sampling/importance_sampling_ratio/clipped_fraction": "mean",
}


def test_sampling_stats_hand_values():
    # |trainer - sampling| on active, scored tokens: 0.8, 0.3, 0.2, 0.9 (NaN and padding left out)
    stats = stats_of("sequence_mask", (None, 3.0))
    assert {k: s.kind for k, s in stats.items()} == STAT_KINDS
    torch.testing.assert_close(stats["sampling/sampling_logp_difference/mean"].value, torch.tensor([2.2, 4.0]))
    assert stats["sampling/sampling_logp_difference/max"].local() == pytest.approx(0.9)
    # sequence modes: one ratio per row, [0, e^-.9]; row 0 was masked out
    assert stats["sampling/importance_sampling_ratio/min"].local() == 0.0
    assert stats["sampling/importance_sampling_ratio/mean"].local() == pytest.approx(E(-0.9) / 2)
    assert stats["sampling/importance_sampling_ratio/max"].local() == pytest.approx(E(-0.9))
    assert stats["sampling/importance_sampling_ratio/clipped_fraction"].local() == 0.5

    # token modes: the 5 active tokens' ratios [0, e^.3, e^.2, 0, 1]; 2 of 5 outside [0.5, 2]
    stats = stats_of("token_mask", (0.5, 2.0))
    assert stats["sampling/sampling_logp_difference/mean"].local() == pytest.approx(0.55)
    assert stats["sampling/importance_sampling_ratio/min"].local() == 0.0
    mean = stats["sampling/importance_sampling_ratio/mean"]
    torch.testing.assert_close(mean.value, torch.tensor([E(0.3) + E(0.2) + 1.0, 5.0]))
    assert stats["sampling/importance_sampling_ratio/max"].local() == pytest.approx(E(0.3))
    assert stats["sampling/importance_sampling_ratio/clipped_fraction"].value.tolist() == [2.0, 5.0]
    # truncated ratios count as clipped too
    stats = stats_of("token_truncate", (0.5, 2.0))
    assert stats["sampling/importance_sampling_ratio/min"].local() == 0.5
    assert stats["sampling/importance_sampling_ratio/max"].local() == 2.0
    assert stats["sampling/importance_sampling_ratio/clipped_fraction"].local() == pytest.approx(0.4)


@pytest.mark.parametrize("mode", MODES)
def test_sampling_stats_without_active_tokens(mode):
    zeros = [[0.0] * 3, [0.0] * 3]
    stats = stats_of(mode, (None, 3.0), mask=zeros)
    diff = stats["sampling/sampling_logp_difference/mean"]
    assert diff.value.tolist() == [0.0, 0.0] and diff.local() == 0.0  # a zero count, never NaN
    assert math.isnan(stats["sampling/sampling_logp_difference/max"].local())  # reductions skip NaN
    if mode.startswith("token"):
        assert stats["sampling/importance_sampling_ratio/mean"].value.tolist() == [0.0, 0.0]
        assert math.isnan(stats["sampling/importance_sampling_ratio/min"].local())
        assert math.isnan(stats["sampling/importance_sampling_ratio/max"].local())
    else:  # every row counts in the sequence modes (1.16); with no tokens each ratio is e^0 = 1
        assert stats["sampling/importance_sampling_ratio/mean"].value.tolist() == [2.0, 2.0]
        assert stats["sampling/importance_sampling_ratio/min"].local() == 1.0
    for stat in stats.values():
        if stat.kind == "mean":
            assert not torch.isnan(stat.value).any()


def test_sampling_stats_when_the_engine_scored_nothing():
    stats = stats_of("token_truncate", (None, 3.0), sampling=[[NAN] * 3, [NAN] * 3])
    assert stats["sampling/sampling_logp_difference/mean"].value.tolist() == [0.0, 0.0]
    assert math.isnan(stats["sampling/sampling_logp_difference/max"].local())
    assert stats["sampling/importance_sampling_ratio/mean"].local() == 1.0  # unscored tokens weigh 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(3))
def test_sampling_stats_match_reference(mode, seed):
    trainer, sampling, mask = random_batch(seed)
    rho, outside = sampling_ratio(trainer, sampling, mask, mode, 0.5, 2.0)
    stats = sampling_stats(trainer, sampling, mask, rho, outside)
    exp_rho, exp_outside = reference_ratio(trainer, sampling, mask, mode, 0.5, 2.0)
    expected = reference_stats(trainer, sampling, mask, exp_rho, exp_outside, mode.startswith("sequence"))
    assert set(stats) == set(expected)
    for key, value in expected.items():
        assert stats[key].local() == pytest.approx(value, rel=1e-6), key


def test_sampling_stats_mean_reduces_as_global_sums():
    """Two processes' (sum, count) add up to the statistic of the joined batch (not the mean of means)."""
    trainer, sampling, mask = random_batch(1)
    parts = [slice(0, 2), slice(2, 6)]  # row 2 has no tokens: an uneven split

    def stats(rows):
        rho, outside = sampling_ratio(trainer[rows], sampling[rows], mask[rows], "token_mask", 0.5, 2.0)
        return sampling_stats(trainer[rows], sampling[rows], mask[rows], rho, outside)

    whole = stats(slice(None))
    for key, stat in whole.items():
        if stat.kind == "mean":
            total = sum(stats(rows)[key].value for rows in parts)
            torch.testing.assert_close(total, stat.value)


# ---- off_policy_mask -------------------------------------------------------------------------------------------


def test_off_policy_mask_hand_values():
    # every logp is -1; q - logp per token, threshold 0.5:
    logps = t64([[-1.0] * 3] * 6).requires_grad_(True)
    drift = [
        [2.0, 2.0, 2.0],  # A = +1, kl 2: kept (a non-negative advantage is always kept)
        [0.4, 0.4, 0.4],  # A = -1, kl 0.4 <= 0.5: kept
        [0.6, 0.6, 0.6],  # A = -1, kl 0.6 > 0.5: dropped
        [0.5, 0.5, 0.5],  # A = -1, kl exactly 0.5: kept (<=)
        [0.3, NAN, 10.0],  # A = -1, NaN counts 0, padding left out: kl (0.3 + 0) / 2 = 0.15, kept
        [5.0, 5.0, 5.0],  # A = 0, kl 5: kept
    ]
    mask = t64([[1.0] * 3] * 4 + [[1.0, 1.0, 0.0], [1.0] * 3])
    adv = t64([1.0, -1.0, -1.0, -1.0, -1.0, 0.0])
    sampler = logps.detach() + t64(drift)
    keep = off_policy_mask(adv, logps, sampler, mask, 0.5)
    assert keep.shape == (6, 1) and not keep.requires_grad
    assert keep.tolist() == [[1.0], [1.0], [0.0], [1.0], [1.0], [1.0]]
    assert torch.equal(off_policy_mask(adv.unsqueeze(1), logps, sampler, mask, 0.5), keep)  # (B, 1) advantages
    # a sampler behind the policy (kl < 0) never drops; a row without tokens has kl 0
    assert off_policy_mask(-adv.abs() - 1, logps, logps.detach() - 3.0, mask, 0.0).eq(1.0).all()
    assert off_policy_mask(t64([-1.0]), logps[:1], sampler[:1], t64([[0.0] * 3]), 0.0).item() == 1.0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("threshold", [0.0, 0.05, 0.2])
def test_off_policy_mask_matches_reference(seed, threshold):
    trainer, sampling, mask = random_batch(seed)
    adv = torch.randn(trainer.shape[0], generator=torch.Generator().manual_seed(seed), dtype=F64)
    adv[1] = 0.0
    keep = off_policy_mask(adv, trainer, sampling, mask, threshold)
    assert keep.tolist() == reference_opsm(adv, trainer, sampling, mask, threshold)


# ---- policy_loss with rho and OPSM ------------------------------------------------------------------------------


def params(loss_type="dapo", **kw):
    kw.setdefault("max_completion_length", 4)
    return LossParams(loss_type=loss_type, **kw)


def loss_batch(seed, B=6, T=5, lengths=(5, 3, 0, 1, 5, 4)):
    """Off-policy log-probs, a reference model and an engine; advantages with both signs and a zero."""
    g = torch.Generator().manual_seed(seed)
    logps = (-3 * torch.rand(B, T, generator=g, dtype=F64)).requires_grad_(True)
    mask = torch.zeros(B, T, dtype=F64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    old = logps.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    ref = logps.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    sampler = logps.detach() + 0.4 * torch.randn(B, T, generator=g, dtype=F64)
    sampler[0] += 0.5  # A < 0 and far off: OPSM drops row 0 at small thresholds
    sampler[5] -= 0.5  # A < 0 and behind the policy: kept
    sampler[0, 1] = NAN
    adv = t64([-1.0, 0.7, -0.4, -1.2, 0.0, -0.8])
    ent = (torch.rand(B, T, generator=g) > 0.3).to(F64)
    return logps, old, adv, mask, ref, sampler, ent


def reference_clipped_loss(logps, old, adv, mask, p, ref, sampler, ent, rho):
    """grpo / dapo from spec §2.3-2.7, row by row: L_t = -min(r A, clip(r) A) x opsm_i x ent_t x rho, + beta kl."""
    B, T = logps.shape
    keeps = reference_opsm(adv, logps, sampler, mask, p.off_policy_mask_threshold)
    rows, lengths = [], []
    for i in range(B):
        a = adv[i].item()
        m = [mask[i, t].item() for t in range(T)]
        keep = keeps[i][0]
        row = 0.0
        for t in range(T):
            r = torch.exp(logps[i, t] - old[i, t])
            r_clip = torch.clamp(r, 1 - p.epsilon_low, 1 + p.epsilon_high)
            policy = -torch.minimum(r * a, r_clip * a)
            weight = rho[i, t if rho.shape[1] > 1 else 0].item()
            delta = ref[i, t] - logps[i, t]
            kl = (torch.exp(delta) - delta - 1) * r  # use_bias_correction_kl (1.16 default)
            row = row + m[t] * (policy * keep * ent[i, t].item() * weight + p.beta * kl)
        rows.append(row)
        lengths.append(sum(m))
    if p.loss_type == "grpo":
        return sum(rows[i] / max(lengths[i], 1.0) for i in range(B)) / B
    return sum(rows) / sum(lengths)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("rho_shape", ["token", "sequence"])
@pytest.mark.parametrize("seed", range(3))
def test_policy_loss_order_matches_reference(loss_type, rho_shape, seed):
    """OPSM, the entropy mask and rho multiply the policy term; beta * kl is added after, weighted by none."""
    logps, old, adv, mask, ref, sampler, ent = loss_batch(seed)
    mode = "token_truncate" if rho_shape == "token" else "sequence_truncate"
    rho, _ = sampling_ratio(old, sampler, mask, mode, 0.5, 2.0)
    p = params(loss_type, beta=0.3, off_policy_mask_threshold=0.05)
    dropped = off_policy_mask(adv, logps, sampler, mask, 0.05).squeeze(1)
    assert (dropped == 0).any() and ((dropped == 1) & (adv < 0)).any()  # both OPSM branches run
    loss, _ = policy_loss(logps, old, adv, mask, p, ref, entropy_mask=ent, sampler_logps=sampler, is_ratio=rho)
    expected = reference_clipped_loss(logps, old, adv, mask, p, ref, sampler, ent, rho)
    (grad,) = torch.autograd.grad(loss, logps)
    (exp_grad,) = torch.autograd.grad(expected, logps)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, exp_grad, rtol=1e-10, atol=1e-12)


def test_kl_is_not_reweighted_hand_value():
    """rho = 0 everywhere and every row dropped by OPSM leave only beta * kl. On-policy with ref = logp + ln 2:
    kl_t = 2 - ln 2 - 1 = 1 - ln 2 per token, so the dapo loss is beta (1 - ln 2) (a token mean)."""
    logps = t64([[-1.0, -2.0, -0.5], [-1.0, -1.0, -7.0]]).requires_grad_(True)
    mask, adv = t64(MASK), t64([-2.0, -1.0])
    ref = logps.detach() + math.log(2.0)
    p = params("dapo", beta=0.1, off_policy_mask_threshold=0.0)
    loss, metrics = policy_loss(
        logps, None, adv, mask, p, ref, sampler_logps=logps.detach() + 1.0, is_ratio=torch.zeros(2, 3, dtype=F64)
    )
    assert loss.item() == pytest.approx(0.1 * (1 - math.log(2.0)), rel=1e-12)
    assert metrics["kl"] == pytest.approx(1 - math.log(2.0), rel=1e-6)  # metrics are float32


def test_opsm_sampler_defaults_to_old_then_to_logps():
    logps, old, adv, mask, ref, sampler, _ = loss_batch(0)
    p = params("dapo", off_policy_mask_threshold=0.02)
    default, _ = policy_loss(logps, old, adv, mask, p)
    explicit, _ = policy_loss(logps, old, adv, mask, p, sampler_logps=old)
    unmasked, _ = policy_loss(logps, old, adv, mask, params("dapo"))
    assert torch.equal(default, explicit) and not torch.equal(default, unmasked)
    # on-policy, the sampler defaults to sg(logp): kl 0, nothing is dropped
    on_policy, _ = policy_loss(logps, None, adv, mask, p)
    assert torch.equal(on_policy, policy_loss(logps, None, adv, mask, params("dapo"))[0])
    # sampler_logps without a threshold is not read
    ignored, _ = policy_loss(logps, old, adv, mask, params("dapo"), sampler_logps=sampler)
    assert torch.equal(ignored, unmasked)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_neutral_rho_and_opsm_are_bit_identical_to_none(loss_type):
    """rho = 1 and a threshold no row exceeds change nothing, bit for bit (x 1.0 and + log 1 are exact)."""
    logps, old, adv, mask, ref, sampler, ent = loss_batch(1)
    base = params(loss_type, beta=0.2)
    neutral = params(loss_type, beta=0.2, off_policy_mask_threshold=math.inf)
    results = []
    for p, rho in [(base, None), (neutral, torch.ones_like(old)), (neutral, torch.ones(6, 1, dtype=F64))]:
        loss, metrics = policy_loss(
            logps, old, adv, mask, p, ref, entropy_mask=ent, sampler_logps=sampler, is_ratio=rho
        )
        (grad,) = torch.autograd.grad(loss, logps)
        results.append((loss, grad, dict(metrics)))
    for loss, grad, metrics in results[1:]:
        assert torch.equal(loss, results[0][0]) and torch.equal(grad, results[0][1])
        assert metrics.keys() == results[0][2].keys()  # OPSM and rho add no metric (1.16)
        for key, value in metrics.items():
            assert value == results[0][2][key] or (math.isnan(value) and math.isnan(results[0][2][key])), key


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo", "sapo"])
def test_rho_is_a_constant_weight(loss_type):
    """d loss / d logp_t scales by rho_t; no gradient reaches rho."""
    logps, old, adv, mask, *_ = loss_batch(2)
    rho = (0.5 + torch.rand(6, 5, generator=torch.Generator().manual_seed(0), dtype=F64)).requires_grad_(True)
    plain, _ = policy_loss(logps, old, adv, mask, params(loss_type))
    weighted, _ = policy_loss(logps, old, adv, mask, params(loss_type), is_ratio=rho)
    (g_plain,) = torch.autograd.grad(plain, logps)
    g_weighted, g_rho = torch.autograd.grad(weighted, [logps, rho], allow_unused=True)
    torch.testing.assert_close(g_weighted, rho.detach() * g_plain, rtol=1e-12, atol=1e-15)
    assert g_rho is None


def reference_vespo(logps, old, adv, mask, p, rho):
    """VESPO (spec §2.5, TRL 1.16 get_gamma_weights) with a token rho, row by row: log W_i = clamp(sum_t m_t
    clamp(l_t, -20, 20) + sum_t clamp(log rho_t, log 1e-8, 20), log 1e-8, 20) (rho's sum is over every position);
    L_t = -phi_i A_i logp_t; token sum over the active tokens. Returns (loss, phis)."""
    B, T = logps.shape
    floor = math.log(1e-8)
    total, phis = 0.0, []
    for i in range(B):
        a = adv[i].item()
        s = 0.0
        for t in range(T):
            s += mask[i, t].item() * min(max((logps[i, t] - old[i, t]).item(), -20.0), 20.0)
            r = rho[i, t].item()
            s += min(max(math.log(r) if r > 0 else -math.inf, floor), 20.0)
        log_w = min(max(s, floor), 20.0)
        k, lam = (p.vespo_k_pos, p.vespo_lambda_pos) if a >= 0 else (p.vespo_k_neg, p.vespo_lambda_neg)
        phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
        phis.append(phi)
        total = total + sum(-phi * a * logps[i, t] * mask[i, t].item() for t in range(T))
    return total / mask.sum().item(), phis


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_vespo_folds_rho_into_its_sequence_weight(mode):
    logps, old, adv, mask, ref, sampler, _ = loss_batch(3)
    rho, outside = sampling_ratio(old, sampler, mask, mode, 0.8, 1.25)
    assert outside.any()  # token_mask: some rho_t = 0, whose log is floored at log 1e-8
    p = params("vespo")
    loss, metrics = policy_loss(logps, old, adv, mask, p, is_ratio=rho)
    expected, phis = reference_vespo(logps, old, adv, mask, p, rho)
    (grad,) = torch.autograd.grad(loss, logps)
    (exp_grad,) = torch.autograd.grad(expected, logps)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, exp_grad, rtol=1e-10, atol=1e-12)
    assert metrics["vespo/phi_seq_mean"] == pytest.approx(sum(phis) / len(phis), rel=1e-6)
    # rho is not also multiplied into the vespo loss
    plain, _ = policy_loss(logps, old, adv, mask, p)
    assert not torch.allclose(loss, plain)
    assert not torch.allclose(loss, policy_loss(logps, old, adv, mask, params("dapo"), is_ratio=rho)[0])


def test_loss_params_read_the_threshold_by_name():
    values = {f: getattr(LossParams(), f) for f in LossParams.__dataclass_fields__}
    config = SimpleNamespace(**values, epsilon=0.2)
    assert LossParams.of(config).off_policy_mask_threshold is None
    config.off_policy_mask_threshold = 0.5
    assert LossParams.of(config).off_policy_mask_threshold == 0.5


def test_stats_are_losses_stat():
    assert all(isinstance(s, Stat) for s in stats_of("token_mask", (None, 3.0)).values())
