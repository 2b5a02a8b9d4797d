"""Memory of a long-lived process: the C heap's freed pages given back to the OS while a model loads (glibc
``malloc_trim``), and start-up's objects frozen out of the garbage collector's sight (:func:`freeze_startup_objects`).

Loading frees each matrix's file bytes as its packed copy arrives. The holes they leave between the weights that
stay would remain resident (glibc returns only the top of the heap by itself), so loading trims as it goes: a
1.2B-parameter IQ4_XS file peaked at 1,256 MiB and held 1,250 MiB after load without it, 968 and 875 MiB with it,
for ~0.1 s of trims. A trim costs ~0.2 ms even with little to give back, which the 1,254 calls of a mixture-of-experts
file (every expert packed alone, 1-2 MB each) made 0.22 s of its load: callers say how many bytes they freed, and a
trim waits until 16 MiB have been. Where the C library has no ``malloc_trim`` (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable
from functools import cache

_BATCH_BYTES = 16 << 20  # freed bytes that make a trim worth its ~0.2 ms
_pending = [0]  # bytes freed since the last trim


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def return_freed_memory(freed_bytes: int | None = None) -> bool:
    """Release the free pages inside the C heap (``malloc_trim(0)``). ``freed_bytes``: what the caller just freed;
    the trim waits until 16 MiB have been (None: trim now, as at the end of a load). False where the C library lacks
    the call or the trim waits."""
    trim = _malloc_trim()
    if trim is None:
        return False
    if freed_bytes is not None:
        _pending[0] += freed_bytes
        if _pending[0] < _BATCH_BYTES:
            return False
    trim(0)
    _pending[0] = 0
    return True


def freeze_startup_objects() -> int:
    """Move every object alive now (torch, the model, the app: ~222,000 with the default model) out of the garbage
    collector's sight for good (``gc.freeze``; vLLM does the same after start-up), and turn collection on if start-up
    held it off (``kvgen.cli.run``). They live as long as the process, and a full collection walked them all,
    141-147 ms here with every stream of a server stalled, 0.01 ms once frozen. Python runs one when the long-lived
    objects have grown by a quarter. Returns how many are frozen. No collection runs first (it took as long): the
    few cycles of garbage start-up leaves (~700 objects) stay. For processes kvgen owns (the CLI, ``kvgen serve``):
    a library caller's later garbage among them would never be freed."""
    gc.freeze()
    gc.enable()
    return gc.get_freeze_count()
