"""The documentation: the README is a front door (at most 250 lines) and the site in docs/ builds with MkDocs in
strict mode, so a broken link, anchor or API reference fails here, not on a reader's screen. The built pages are
also read back for what strict mode lets through but a reader would see as broken: a line starting with `>` that
became a block quote, a table or emphasis left as raw Markdown, or text in angle brackets swallowed as an HTML tag."""

from __future__ import annotations

import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("mkdocs", reason="the docs tools come with grpo's test extra")

# The tags MkDocs Material and Python-Markdown write into a page's article; anything else there is text in angle
# brackets (`<output_dir>` outside a code span) that the browser takes for an element and hides.
HTML_TAGS = set(
    "a abbr article b blockquote br button code col colgroup dd details div dl dt em figcaption figure h1 h2 h3 h4 h5 "
    "h6 hr i img input kbd label li nav ol p path pre s samp section small span strong sub summary sup svg table "
    "tbody td tfoot th thead tr u ul".split()
)


def build(root: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"), "-d", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = build(ROOT, out)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


class Article(HTMLParser):
    """A built page's article: the tags in it, and its text outside code."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # inside <article> when > 0
        self.code = 0
        self.tags: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "article":
            self.depth += 1
        elif self.depth:
            self.tags.append(tag)
            self.code += tag in ("code", "pre")

    def handle_endtag(self, tag):
        if tag == "article":
            self.depth -= 1
        elif self.depth and tag in ("code", "pre"):
            self.code -= 1

    def handle_data(self, data):
        if self.depth and not self.code:
            self.text.append(data)


def pages(site: Path) -> dict[str, Article]:
    read = {}
    for html in sorted(site.glob("**/index.html")):
        name = html.parent.relative_to(site).as_posix()
        name = "home" if name == "." else name
        if name.startswith(("search", "assets")):
            continue
        article = Article()
        article.feed(html.read_text())
        read[name] = article
    return read


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 250
    commands = [line.split("#")[0].strip() for line in readme[:8] if line.startswith("make ")]
    assert commands == ["make demo", "make test"], readme[:8]


def test_the_site_builds_strictly_with_every_page_and_the_api(site):
    home = (site / "index.html").read_text()
    assert "make demo" in home and 'href="recipes/"' in home  # the README, its links into the site
    results = (site / "results" / "index.html").read_text()  # bench/RESULTS.md, its anchors the pages link to
    assert "Measured results" in results and 'id="demo"' in results
    api = (site / "api" / "index.html").read_text()
    assert "accuracy_reward" in api and "GRPOTrainer" in api
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    nav = (ROOT / "mkdocs.yml").read_text()
    assert all(page in nav for page in pages), pages  # every page reachable


def test_no_line_of_prose_starts_with_a_quote_marker():
    """A line that starts with `>` inside a paragraph or list item (`>=5.16` wrapped to a line's start) renders as a
    block quote. The docs quote nothing, so any such line outside a code block is a wrapping accident."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        fenced = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced and line.lstrip().startswith(">"):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:60]}")
    assert not found, "these lines render as block quotes; rewrap them so no line starts with '>':\n" + "\n".join(found)


def test_code_lines_fit_the_page():
    """A code block's line past 80 characters scrolls sideways, its end under the copy button, on a 1280-pixel
    screen (the site's content column beside the navigation and the table of contents)."""
    long = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        fenced = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif fenced and len(line) > 80:
                long.append(f"{path.relative_to(ROOT)}:{number}: {len(line)} characters")
    assert not long, "code lines longer than 80 characters:\n" + "\n".join(long)


def test_the_built_pages_have_no_rendering_accidents(site):
    problems = []
    for name, article in pages(site).items():
        assert article.tags, f"{name}: no article found in the built page"
        text = "".join(article.text)
        if "blockquote" in article.tags:
            problems.append(f"{name}: a block quote (a line starting with '>')")
        for stray in sorted(set(article.tags) - HTML_TAGS):
            problems.append(f"{name}: <{stray}> taken as an HTML tag (put it in a code span or write &lt;)")
        if "|---" in text or "| ---" in text:
            problems.append(f"{name}: a table left as text (a blank line missing before it?)")
        if "**" in text:
            problems.append(f"{name}: '**' left as text (unbalanced emphasis)")
        if "](" in text:
            problems.append(f"{name}: a link left as text")
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_stray_block_quote(tmp_path):
    """The rendering check itself: a wrapped `>=` becomes a block quote in the built page, and is reported."""
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("# Page\n\nvllm-cpu 0.32 needs transformers\n>=5.16.1,<5.20 to run.\n\nA `<tag>` in code.\n")
    (tmp_path / "mkdocs.yml").write_text("site_name: t\ndocs_dir: docs\ntheme: {name: material}\nnav: [page.md]\n")
    done = build(tmp_path, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    article = pages(tmp_path / "site")["page"]
    assert "blockquote" in article.tags and "tag" not in article.tags


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
