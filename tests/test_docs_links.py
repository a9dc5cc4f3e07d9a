"""Every relative link and picture in README.md and docs/*.md points at a file that exists, and
every ``#anchor`` at a heading of its page (GitHub's heading slugs)."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _prose(text: str) -> str:
    """The page without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[*`]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: str) -> set[str]:
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: str) -> list[str]:
    return LINK.findall(_prose(open(path, encoding="utf-8").read()))


def test_slugs_follow_github():
    assert slug("The engine, mapped to vLLM v1") == "the-engine-mapped-to-vllm-v1"
    assert slug("Long prompt (`bench long-prompt`)") == "long-prompt-bench-long-prompt"
    assert slug("What **runs** on a GPU?") == "what-runs-on-a-gpu"


def test_links_found_outside_code_only():
    page = "see [a](a.md) and ![b](img/b.png)\n```\n[c](c.md)\n```\n`[d](d.md)`\n"
    assert LINK.findall(_prose(page)) == ["a.md", "img/b.png"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_and_picture_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
        if not os.path.exists(dest):
            broken.append(f"{target}: no {os.path.relpath(dest, ROOT)}")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {os.path.relpath(dest, ROOT)}")
    assert not broken, f"{os.path.relpath(page, ROOT)}: " + "; ".join(broken)


def test_readme_shows_a_picture():
    pictures = [t for t in links(PAGES[0]) if t.endswith(".png")]
    assert pictures, "README shows no picture"
