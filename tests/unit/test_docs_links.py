"""Links between the README and docs/*.md lead somewhere: the file exists, and an anchor (`#...`) names one of
its headings as GitHub spells heading anchors."""

import pathlib
import re

import pytest

import llmserve

ROOT = pathlib.Path(llmserve.__file__).parent.parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor_of(heading: str) -> str:
    """GitHub's: lower case, punctuation dropped (hyphens and underscores kept), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    return {anchor_of(line.lstrip("#")) for line in page.read_text().splitlines() if re.match(r"#{1,6} ", line)}


def test_anchor_spelling():
    assert anchor_of("CPU vs llama.cpp, side by side (issues 19, 20)") == "cpu-vs-llamacpp-side-by-side-issues-19-20"
    assert anchor_of("The start-up choice under a real neighbour's load") == \
        "the-start-up-choice-under-a-real-neighbours-load"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_local_links_resolve(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(target)
    assert not broken, f"{page.name} links to what does not exist: {broken}"
