"""The documentation: the README is a front door (at most 250 lines) and the site in docs/ builds with MkDocs in
strict mode, so a broken link, anchor or API reference fails here, not on a reader's screen."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("mkdocs", reason="the docs tools come with grpo's test extra")


def build(root: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )


def test_the_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_the_site_builds_strictly_with_every_page_and_the_api(tmp_path):
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    home = (tmp_path / "site" / "index.html").read_text()
    assert "Writing reward functions" in home and 'href="vllm/"' in home  # the README, its links into the site
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "accuracy_reward" in api and "GRPOTrainer" in api
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(page in nav for page in pages), pages  # every page reachable


def test_a_broken_link_fails_the_build(tmp_path):
    copy = tmp_path / "repo"
    for name in ("docs", "scripts", "src"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(ROOT / name, copy / name)
    page = copy / "docs" / "demo.md"
    page.write_text(page.read_text() + "\nSee [the missing page](missing.md).\n")
    done = build(copy, tmp_path / "site")
    assert done.returncode != 0 and "missing.md" in done.stdout + done.stderr
