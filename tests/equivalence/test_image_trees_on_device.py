"""Image rows as token trees on the tests' device (`pytest -m device --device cuda`, as the GPU check runs it): the
tree pass gives the padded pass's numbers there. Kept apart from tests/integration/test_tree_images.py, whose
imports (datasets, the trainer's tests) the GPU machine's image may lack."""

from __future__ import annotations

import pytest
import torch

from grpo.learner import tree_attention
from grpo.learner.tree_images import ImageInputs
from grpo.models.vision import Pixels
from support import on_device
from support.layouts import GRAD_ATOL, gathered, image_pass
from support.vision import BUILDERS, image_batch, turn_pictures_batch


@on_device.mark
@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_image_trees_are_the_padded_pass_on_the_tests_device(arch):
    """On the tests' device (on CUDA: FlexAttention's block-sparse kernel, which must run there), the image rows as
    trees give the padded pass's log-probs, entropies and gradients at that device's float32 tolerance: two
    prompts with images and one without, four completions each (heads of 16 wide)."""
    model, processor = BUILDERS[arch](0, hidden=64)
    device = on_device.device()
    model = model.to(device)
    batch = image_batch(processor, prompts=3).to(device)
    images = ImageInputs.of(model, Pixels.of(processor, model))
    tolerance = on_device.float32_tolerance()
    grad_tolerance = dict(rtol=tolerance["rtol"], atol=max(GRAD_ATOL, tolerance["atol"]))

    padded, laid_out = image_pass(model, batch, images, False)
    trees, tree_laid_out = image_pass(model, batch, images, True)
    assert laid_out == {"padded": 1} and tree_laid_out == {"trees": 1}
    assert tree_attention.attention_kernel(model, device) == ("flex" if device.type == "cuda" else "dense")
    m = batch.mask.bool()
    torch.testing.assert_close(trees[0][m], padded[0][m], **tolerance)
    torch.testing.assert_close(trees[1][m], padded[1][m], **tolerance)
    for name, grad in padded[2].items():  # atol scaled as support.layouts.assert_same_pass's
        scale = max(1.0, float(grad.abs().max()))
        scaled = dict(grad_tolerance, atol=grad_tolerance["atol"] * scale)
        torch.testing.assert_close(trees[2][name], grad, **scaled, msg=name)


@on_device.mark
def test_rendered_turns_with_pictures_are_their_turns_alone_on_the_tests_device():
    """On the tests' device (on CUDA: FlexAttention), Qwen2.5-VL's rendered turns whose histories hold the prompt's
    and a tool's pictures, as trees (positions derived over the forked rows), give each turn's log-probs, entropies
    and gradients scored as a row of its own, at that device's float32 tolerance."""
    model, processor = BUILDERS["qwen2.5-vl"](0, hidden=64)
    device = on_device.device()
    model = model.to(device)
    batch, singles, where = turn_pictures_batch(processor)
    batch, singles = batch.to(device), singles.to(device)
    images = ImageInputs.of(model, Pixels.of(processor, model))
    tolerance = on_device.float32_tolerance()
    alone, _ = image_pass(model, singles, images, False)
    trees, laid_out = image_pass(model, batch, images, True)
    assert laid_out == {"trees": 1}
    m = batch.mask.bool().cpu()
    for got, single in zip(trees[:2], alone[:2]):
        expected = gathered(single.cpu(), where, tuple(m.shape))
        torch.testing.assert_close(got.cpu()[m], expected[m], **tolerance)
    grad_tolerance = dict(rtol=tolerance["rtol"], atol=max(GRAD_ATOL, tolerance["atol"]))
    for name, grad in alone[2].items():
        torch.testing.assert_close(trees[2][name], grad, **grad_tolerance, msg=name)
