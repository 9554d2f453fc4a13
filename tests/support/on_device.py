"""Where the equivalence tests run, chosen in one place: `pytest --device cuda` or GRPO_TEST_DEVICE=cuda (the CPU
by default, as in CI), and the tolerances their comparisons allow, stated once per dtype and device.

The tests that take their device from here carry the `device` mark: `pytest -m device --device cuda` runs just
them on a GPU (scripts/gpu_check.sh does). Both sides of each comparison run on that device.

- float32: the CPU's comparisons allow rtol/atol 1e-5. On CUDA float32 matmuls run without TF32 (torch's default,
  set again here in case a trainer turned it on) but cuBLAS and the attention kernels sum in other orders than the
  reference path does: 1e-4.
- bfloat16 (both sides under bfloat16 autocast, or the fast path's bfloat16 weights): every next-token log-prob
  within 0.05 nats, and the same argmax wherever the reference's best two tokens are further apart than twice
  the largest difference seen (a closer pair may swap under that rounding; on the CPU, where both sides round
  alike, that is every row without an exact tie); sampled tokens' log-probs within 0.01 nats on average.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from grpo.learner.batch import collate
from grpo.learner.forward import token_logps
from grpo.learner.layouts import PassSettings

FLOAT32 = {"cpu": dict(rtol=1e-5, atol=1e-5), "cuda": dict(rtol=1e-4, atol=1e-4)}
BFLOAT16_NATS = 0.05  # the largest difference in any next-token log-prob
BFLOAT16_MEAN_NATS = 0.01  # the mean difference of sampled tokens' log-probs

mark = pytest.mark.device
dtypes = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def device() -> torch.device:
    """The equivalence tests' device: GRPO_TEST_DEVICE (set from `--device` too), else the CPU."""
    name = os.environ.get("GRPO_TEST_DEVICE", "") or "cpu"
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise pytest.UsageError(f"GRPO_TEST_DEVICE={name}, but torch sees no CUDA device here")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    elif dev.type != "cpu":
        raise pytest.UsageError(f"GRPO_TEST_DEVICE={name}: the equivalence tests run on 'cpu' or 'cuda[:n]'")
    return dev


def float32_tolerance(where: torch.device | None = None) -> dict[str, float]:
    """rtol/atol of float32 comparisons on `where` (default: the tests' device)."""
    return FLOAT32["cuda" if (where or device()).type == "cuda" else "cpu"]


def autocast(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """bfloat16 autocast on the device when `dtype` is bfloat16, else nothing."""
    return torch.autocast(device().type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def assert_next_token_logps_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Next-token log-prob rows of a fast path against the reference, at the tolerance of `dtype` here."""
    if dtype != torch.bfloat16:
        torch.testing.assert_close(got, expected, **float32_tolerance(got.device))
        return
    worst = (got - expected).abs().max()
    assert worst < BFLOAT16_NATS
    # the same best token wherever rounding this large could not swap the reference's best two
    top2 = expected.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * worst
    assert torch.equal(got.argmax(-1)[clear], expected.argmax(-1)[clear])


def assert_sampling_logps_match_training(model, pad_token_id, rollout, temperature: float, dtype: torch.dtype) -> None:
    """An engine's sampling log-probs against the training pass's over the same rollout, as the trainer runs both:
    float32 at the device's tolerance; bfloat16 (the engine on bfloat16 weights, the pass under bfloat16 autocast)
    within BFLOAT16_MEAN_NATS on average."""
    batch = collate(rollout, torch.zeros(len(rollout)), pad_token_id, mask_truncated=False).to(model.device)
    with torch.no_grad(), autocast(dtype):
        logps = token_logps(model, batch, PassSettings(temperature, with_entropy=False)).logps
    m = batch.mask.bool()
    if dtype == torch.bfloat16:
        assert (logps[m] - batch.sampling_logps[m]).abs().mean() < BFLOAT16_MEAN_NATS
    else:
        torch.testing.assert_close(logps[m], batch.sampling_logps[m], **float32_tolerance(logps.device))
