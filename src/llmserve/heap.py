"""Start-up heaps kept out of Python's cyclic collector (the engine core and the HTTP front call this once
they are up, as vLLM's engine core and API server do)."""

from __future__ import annotations

import atexit
import gc


def freeze_startup_heap() -> None:
    """Move every object alive now (imported libraries, the tokenizer, the app; in the engine the model and
    its KV blocks, about a million objects for a small model) out of the collector's passes. A full
    collection otherwise walks them all, stalling the engine's step and the front's event loop
    (docs/benchmarks.md, "Figures behind choices in the code"). Frozen objects are
    still freed by reference counting, never by the cyclic collector: the engine holds no reference cycles
    of its own (tests/unit/test_engine_heap.py), so a dropped engine is freed. At exit the heap is unfrozen,
    so that the interpreter's last collection frees it as usual (extensions such as triton's check that)."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # registered once, however many engines a process makes
    atexit.register(gc.unfreeze)
