"""Python's cyclic garbage collector paused around a burst of allocation (the imports of torch
and transformers, building a model on the meta device): such a burst triggers full
collections, each walking every object the process holds, and a process that has read a
many-rank layout holds hundreds of thousands (every piece of every rank file). The objects
are collected later as usual."""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def paused_gc():
    """Pause the cyclic collector for the ``with`` block; restored as it was (nested blocks
    leave it to the outermost)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
