"""The memory a check of images takes, measured in a fresh process's peak resident size (issue #32 item 4; the pixel
budget itself: tests/unit/test_image_budget.py): a bomb is refused from its header without its pixels, and checking
every row's images holds one image at a time."""

from __future__ import annotations

import json
import subprocess
import sys

from PIL import Image


def test_refusing_a_bomb_costs_no_memory(bombs):
    """Measured in a fresh process: the peak resident memory grows by less than 50 MB while the 12000x12000 PNG
    (which PIL alone would decode to 144 MB, 432 MB as RGB) is refused."""
    code = (
        "import json, resource, sys\n"
        "from grpo.models import vision\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    vision.load_image(sys.argv[1], 0)\n"
        "    error = None\n"
        "except ValueError as err:\n"
        "    error = str(err)\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(json.dumps({'grown_kb': after - before, 'error': error}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, bombs[12000]], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["error"] and "12000x12000" in result["error"]
    assert result["grown_kb"] < 50_000, result


def test_checking_every_image_holds_one_at_a_time(tmp_path):
    """Measured in a fresh process: checking 40 images of 2000x1500 (8.6 MB each decoded, 344 MB together) grows
    the peak resident memory by far less than all of them would take."""
    for i in range(40):
        Image.new("RGB", (2000, 1500), (i, 2 * i, 3 * i)).save(tmp_path / f"{i}.png")
    code = (
        "import json, resource, sys\n"
        "from grpo.models import vision\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "for i in range(40):\n"
        "    vision.check_image_file(f'{sys.argv[1]}/{i}.png', i)\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print(json.dumps({'grown_kb': after - before}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    grown = json.loads(out.stdout.strip().splitlines()[-1])["grown_kb"]
    assert grown < 100_000, grown
