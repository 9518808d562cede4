"""The embedded demo model: a small deterministic random Llama with a byte-level tokenizer and a
ChatML template, built once under `cache_dir()/demo-model-v3` (written to a temp dir, then renamed,
so concurrent builders never see half a checkpoint) and reused afterwards.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from llmserve.config import cache_dir

DEMO_NAME = "demo-model-v3"
DEMO_SEED = 1234
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                   "generation_config.json")


def _is_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in _REQUIRED_FILES)


def demo_model_path() -> str:
    """Path of the demo checkpoint, building it first if this machine has none yet."""
    root = cache_dir()
    path = os.path.join(root, DEMO_NAME)
    if _is_complete(path):
        return path
    from llmserve.testing.maker import SHAPES, write_checkpoint  # the demo is a random checkpoint of shape "demo"

    tmp = tempfile.mkdtemp(prefix=f".{DEMO_NAME}-", dir=root)
    try:
        write_checkpoint("llama", SHAPES["demo"], tmp, seed=DEMO_SEED)
        try:
            os.rename(tmp, path)
        except OSError:  # another process won the race (or a stale incomplete dir is in the way)
            if not _is_complete(path):
                shutil.rmtree(path, ignore_errors=True)
                os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
