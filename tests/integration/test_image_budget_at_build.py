"""The pixel budget when the trainer is built (issue #32 item 4; the budget itself, without a trainer:
tests/unit/test_image_budget.py): every row's images are checked at construction (the size from the header before any
pixel is decoded, then each image decoded once and dropped: a truncated file is found before step 1), each problem
named by row and path."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from support.images import CHAT
from support.vision import image
from support.vision_runs import build


def test_every_rows_images_are_checked_when_the_trainer_is_built(tmp_path, bombs, never_decoded):
    """A missing file, an unreadable file, undecodable bytes, an image past the budget (as a path, as bytes, as a
    PIL image) and an 'images' value that is not a list: each is one error naming the row, before training, with no
    image decoded (the good rows' images are PIL images already, their files' headers only are read)."""
    good = [{"prompt": CHAT, "image": image(i)} for i in range(3)]
    missing = str(tmp_path / "nowhere.png")
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image at all")
    cases = {
        f"row 3: the image file {missing} does not exist": {"prompt": CHAT, "image": {"path": missing, "bytes": None}},
        f"row 3: cannot read the image {broken}": {"prompt": CHAT, "image": str(broken)},
        f"row 3: the image {bombs[12000]} is 12000x12000 pixels": {"prompt": CHAT, "image": bombs[12000]},
        "row 3: the image <image 9000x8000> is 9000x8000 pixels": {
            "prompt": CHAT,
            "image": Image.new("L", (9000, 8000)),
        },
        "row 3: the 'images' column holds a str": {"prompt": CHAT, "images": bombs[20000]},
        "row 3: an image is a PIL image or a file path; got int": {"prompt": CHAT, "image": 7},
    }
    for message, row in cases.items():
        column = "images" if "images" in row else "image"
        rows = [{"prompt": r["prompt"], column: [r["image"]] if column == "images" else r["image"]} for r in good]
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            build(tmp_path, [*rows, row])


def truncated_png(path, size=(64, 48)):
    """A PNG whose header is valid and whose pixel data is cut in half: it opens, and fails only when decoded."""
    buffer = io.BytesIO()
    image(3, *size).save(buffer, format="PNG")
    raw = buffer.getvalue()
    with open(path, "wb") as f:
        f.write(raw[: len(raw) // 2])
    return str(path)


def test_a_truncated_image_is_named_before_training(tmp_path):
    """A truncated PNG (valid header, data cut): as a path, and as a PIL image opened from it and not yet read, one
    error naming the row when the trainer is built, not at the step that first uses the row."""
    cut = truncated_png(tmp_path / "cut.png")
    with Image.open(cut) as opened:
        assert opened.size == (64, 48)  # the header reads
        for value in (cut, opened):
            rows = [{"prompt": CHAT, "image": image(i)} for i in range(3)] + [{"prompt": CHAT, "image": value}]
            with pytest.raises(ValueError, match=f"row 3: cannot read the image {cut}: image file is truncated"):
                build(tmp_path, rows)
