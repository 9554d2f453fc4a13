"""A pixel budget for images, checked from the header before anything is decoded (issue #32 item 4): a 0.4 MB PNG of
20000x20000 pixels would decode to 1.2 GB. Dataset files and bytes, dataset PIL images and a generation server's
base64 images are held to `grpo.models.vision.MAX_IMAGE_PIXELS`; PIL's decompression-bomb warning and error become the
same one error; every row's images are checked when the trainer is built (the size from the header before any pixel
is decoded, then each image decoded once and dropped: a truncated file is found before step 1), each problem named
by row and path (those tests build a trainer: tests/integration/test_image_budget_at_build.py; the memory each check
takes is measured in fresh processes: tests/integration/test_image_memory.py)."""

from __future__ import annotations

import base64
import io

import pytest
from datasets import Dataset
from datasets import Image as ImageFeature
from PIL import Image

from grpo.data import prompts as data
from grpo.models import vision
from support.images import CHAT
from support.vision import BUILDERS, image


@pytest.mark.parametrize("side", [20000, 12000])
def test_an_image_past_the_budget_is_refused_from_its_header(bombs, side, never_decoded, recwarn):
    path = bombs[side]
    size = f"{side}x{side} pixels" if side == 12000 else "over PIL's decompression-bomb limit .*400000000 pixels"
    message = f"row 3: the image {path} is {size}.*, more than grpo decodes .*MAX_IMAGE_PIXELS"
    with pytest.raises(ValueError, match=message):
        vision.check_image_file(path, 3)
    with pytest.raises(ValueError, match=message):
        vision.load_image(path, 3)
    with open(path, "rb") as f:
        raw = f.read()
    with pytest.raises(ValueError, match=f"row 3: the image {path} is {size}"):
        vision.load_image({"bytes": None, "path": path}, 3)
    with pytest.raises(ValueError, match=f"row 1: the image \\(image bytes\\) is {size}"):
        vision.check_image_file({"bytes": raw, "path": None}, 1)
    # the generation server's route: a ValueError naming the request field (the server answers 400 with it)
    with pytest.raises(ValueError, match=rf"requests\[0\]\.images\[1\] is {size}"):
        vision.decode_image(base64.b64encode(raw).decode(), "requests[0].images[1]")
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]


def test_the_budget_is_a_module_constant_and_pils_own_limit_is_the_same_error(bombs, monkeypatch, never_decoded):
    small = image(0, 40, 30)  # 1200 pixels
    monkeypatch.setattr(vision, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(ValueError, match="row 0: the image <image 40x30> is 40x30 pixels"):
        vision.check_image_file(small, 0)
    buffer = io.BytesIO()
    small.save(buffer, format="PNG")
    with pytest.raises(ValueError, match=r"requests\[2\]\.images\[0\] is 40x30 pixels"):
        vision.decode_image(base64.b64encode(buffer.getvalue()).decode(), "requests[2].images[0]")
    monkeypatch.setattr(vision, "MAX_IMAGE_PIXELS", 10**12)  # raised past PIL's: PIL's refusal, as one clear error
    with pytest.raises(ValueError, match=f"row 4: the image {bombs[20000]} .*raise .* and PIL.Image.MAX_IMAGE_PIXELS"):
        vision.check_image_file(bombs[20000], 4)


def test_an_image_within_the_budget_decodes_as_before(tmp_path):
    path = tmp_path / "fine.png"
    image(1, 50, 20).save(path)
    loaded = vision.load_image(str(path), 0)
    assert loaded.size == (50, 20) and loaded.mode == "RGB" and loaded.tobytes() == image(1, 50, 20).tobytes()
    assert vision.decode_image(vision.encode_image(loaded), "x").tobytes() == loaded.tobytes()


def test_a_datasets_image_column_of_bytes_is_checked_when_the_trainer_is_built(tmp_path, bombs):
    """A datasets.Image column holds undecoded bytes: each row's image is read when the trainer is built (a bomb
    refused from its header)."""
    with open(bombs[20000], "rb") as f:
        bomb = f.read()
    buffer = io.BytesIO()
    image(0).save(buffer, format="PNG")
    for bad, message in (
        (b"garbage", r"row 2: cannot read the image \(image bytes\)"),
        (bomb, "row 2: .*decompression-bomb limit"),
        (
            buffer.getvalue()[: len(buffer.getvalue()) // 2],
            r"row 2: cannot read the image \(image bytes\): image file is truncated",
        ),
    ):
        column = [{"bytes": buffer.getvalue(), "path": None}] * 2 + [{"bytes": bad, "path": None}, None]
        dataset = Dataset.from_dict({"prompt": [CHAT] * 4, "image": column}).cast_column("image", ImageFeature())
        assert type(dataset.features["image"]).__name__ == "Image"
        with pytest.raises(ValueError, match=message):
            data.check_images(dataset, BUILDERS["qwen2.5-vl"](0)[1])
