import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/ only, not its tiers: helpers are imported from support.*
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from support import on_device  # noqa: E402
from support.images import bomb_png  # noqa: E402
from support.tiny import save_tiny  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default=None,
        help="the device of the equivalence tests (the `device` mark): cpu (default) or cuda; or GRPO_TEST_DEVICE",
    )


def _xdist_workers() -> int:
    """How many pytest-xdist workers run this session (1 without xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)


def _share_the_cores() -> None:
    """Under pytest-xdist (`make test` runs the main tiers on two workers), each worker takes its share of the cores
    for torch's threads and its children's (OMP_NUM_THREADS): OpenMP threads outnumbering the cores spin against each
    other. On 2 cores, 2 workers at one thread each ran the main tiers in 563 s (15.6 CPU-minutes), against 977 s
    (29.5 CPU-minutes) at two threads each and 923 s in one process (bench/RESULTS.md, test-suite). Tests whose
    subject is several threads set their own count (`test_lean_decode`'s kernel across thread counts)."""
    workers = _xdist_workers()
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(torch.get_num_threads() // workers, 1)  # OpenMP's default: the cores this process may use
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


# the tiers in the order two workers take them up (`--dist load`: each takes the next test when it is free), the
# process-driven ones first: the unit and equivalence tiers' ~1100 short tests are left to fill the end, so neither
# worker waits long on the other's last test (a 45 s test begun last had the other idle for as long)
FIRST_TO_LAST = ("distributed", "integration", "equivalence", "unit")


def pytest_collection_modifyitems(config, items):
    if _xdist_workers() > 1:
        here = os.path.dirname(__file__)

        def tier(item) -> int:
            top = os.path.relpath(str(item.path), here).split(os.sep)[0]
            return FIRST_TO_LAST.index(top) if top in FIRST_TO_LAST else len(FIRST_TO_LAST)

        items.sort(key=tier)  # stable: each tier keeps its own order


def pytest_configure(config):
    config.addinivalue_line("markers", "device: an equivalence test that runs on --device / GRPO_TEST_DEVICE")
    _share_the_cores()
    if config.getoption("--device"):
        os.environ["GRPO_TEST_DEVICE"] = config.getoption("--device")
    on_device.device()  # a device this machine lacks stops the run here, with one message


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture
def restores_determinism():
    """`full_determinism` switches torch process-wide: the flags and variables it sets, as they were before the test."""
    names = (
        "CUDA_LAUNCH_BLOCKING",
        "CUBLAS_WORKSPACE_CONFIG",
        "ASCEND_LAUNCH_BLOCKING",
        "HCCL_DETERMINISTIC",
        "FLASH_ATTENTION_DETERMINISTIC",
    )
    env = {n: os.environ.get(n) for n in names}
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    yield
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    torch.use_deterministic_algorithms(flags[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = flags[1], flags[2]


@pytest.fixture(scope="module")
def bombs(tmp_path_factory):
    """Paths of a 20000x20000 PNG (past PIL's error limit) and a 12000x12000 one (PIL only warns, then decodes)."""
    folder = tmp_path_factory.mktemp("bombs")
    paths = {}
    for side in (20000, 12000):
        paths[side] = str(folder / f"bomb{side}.png")
        with open(paths[side], "wb") as f:
            f.write(bomb_png(side, side))
    assert os.path.getsize(paths[20000]) < 500_000
    return paths


@pytest.fixture
def never_decoded(monkeypatch):
    """Fails the test if any image's pixels are read."""
    from PIL import ImageFile  # here: the GPU check's equivalence tests run where Pillow may be missing

    def load(self):
        raise AssertionError(f"decoded a {self.size} image")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
