"""docs/architecture.md stays true to the tree: every file it names exists, and its package table has a row
for every package under src/llmserve."""

import pathlib
import re

import llmserve

SRC = pathlib.Path(llmserve.__file__).parent
ROOT = SRC.parent.parent
DOC = ROOT / "docs" / "architecture.md"
FILE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|md))\b")
DIR = re.compile(r"`((?:[\w-]+/)+)`")


def _path(name: str) -> pathlib.Path:
    return ROOT / name if name.split("/")[0] in ("tests", "docs", "src", "scripts") else SRC / name


def test_every_file_the_map_names_exists():
    text = DOC.read_text()
    names = set(FILE.findall(text)) | set(DIR.findall(text))
    assert len(names) > 60  # the regexes still find the map's files
    missing = sorted(name for name in names if not _path(name).exists())
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_every_package_has_a_row():
    rows = {line.split("|")[1].strip().strip("`") for line in DOC.read_text().splitlines()
            if line.startswith("| `")}
    packages = {f"{p.name}/" for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert packages <= rows, f"packages without a row in docs/architecture.md: {sorted(packages - rows)}"
