"""The `llmserve` command line: --version, and config errors as argparse-style errors (exit 2)."""

from __future__ import annotations

import pytest

from llmserve import __version__
from llmserve.cli import main


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"llmserve {__version__}"
