"""MkDocs hook for `make docs`: two pages of the site are files kept elsewhere in the repository (one text, not
two): the home page is the README, and "Measured results" is `bench/RESULTS.md`. Their links into docs/ are made
relative to the site, and their links to other files of the repository are made plain text."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# site page -> (the file it shows, how that file's links into docs/ begin)
PAGES = {"index.md": (ROOT / "README.md", "docs/"), "results.md": (ROOT / "bench" / "RESULTS.md", "../docs/")}


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri not in PAGES:
        return markdown
    source, into_docs = PAGES[page.file.src_uri]
    text = source.read_text().replace(f"]({into_docs}", "](").replace("](bench/RESULTS.md", "](results.md")
    return re.sub(r"\[([^\]]+)\]\((?!https?:|#)([^)]*/[^)]*)\)", r"\1", text)  # e.g. src/... paths
