"""MkDocs hook for `make docs`: the site's home page is the repository's README (one text, not two), with its links
into docs/ made relative to the site and its links to files outside docs/ made plain code."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    text = README.read_text()
    text = text.replace("](docs/", "](")
    return re.sub(r"\[([^\]]+)\]\((?!https?:|#)([^)]*/[^)]*)\)", r"\1", text)  # e.g. src/... paths
