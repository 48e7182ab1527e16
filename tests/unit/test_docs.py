"""The documentation against the code: docs/api.md is what tools/api_reference.py writes from
the code, and every relative link in README.md and docs/*.md reaches a file (and, in a
Markdown file, a heading or an explicit anchor)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`+[^`\n]*`+")
# [text](target) or [text](target "title"); images too (![alt](target))
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_LINK = re.compile(r"""<a\s[^>]*href=["']([^"']+)["']""", re.I)
EXPLICIT_ANCHOR = re.compile(r"""<a\s[^>]*(?:id|name)=["']([^"']+)["']""", re.I)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The Markdown without code blocks and inline code, where links are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    found: set[str] = set()
    seen: dict[str, int] = {}
    for match in HEADING.finditer(text):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    found.update(EXPLICIT_ANCHOR.findall(text))
    return found


def links(path: Path) -> list[str]:
    text = prose(path.read_text(encoding="utf-8"))
    return LINK.findall(text) + HTML_LINK.findall(text)


def is_external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)) or target.startswith("//")


def test_api_reference_is_current():
    """docs/api.md is what tools/api_reference.py writes from the code today."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "api_reference.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr + result.stdout


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in links(page):
        if is_external(target):
            continue
        file_part, _, fragment = target.partition("#")
        destination = (page.parent / unquote(file_part)).resolve() if file_part else page
        if not destination.exists():
            broken.append(f"{target}: no file {destination}")
            continue
        if (
            fragment
            and destination.suffix == ".md"
            and unquote(fragment) not in anchors(destination)
        ):
            broken.append(f"{target}: no heading or anchor #{fragment} in {destination.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_link_checker_sees_links():
    """The checker finds the README's links to docs/ (a pattern that found none would pass)."""
    targets = links(ROOT / "README.md")
    assert any(t.startswith("docs/api.md") for t in targets), targets
    assert slug("3.11 `p.grad` after backward; gradient clipping") == (
        "311-pgrad-after-backward-gradient-clipping"
    )
