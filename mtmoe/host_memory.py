"""Keep freed host memory in the process (glibc's ``mallopt``) so that training steps on a CPU reuse it.

A training step allocates and frees the same large tensors every time (activations of ``[P, B, n * units]``
floats: 8 MiB for one MovieLens trial, 32 MiB for a pack of four). With glibc's default policy such blocks are
mapped fresh from the kernel (``mmap`` above a threshold, or heap memory trimmed and grown back), and every page is
faulted in and zeroed again on first touch, at every step (benchmarks/README.md, "Freed memory"). This module's
:func:`keep_freed_memory` raises glibc's trim threshold and top padding so freed memory stays in the heap, and
fixes the mmap threshold at its maximum (32 MiB) so that it no longer adapts. Elsewhere (macOS, musl, Windows) it
does nothing.
"""
from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Set glibc's allocator to keep freed memory; whether it could (Linux with glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    settings = ((M_MMAP_THRESHOLD, 32 << 20), (M_TOP_PAD, 1 << 30), (M_TRIM_THRESHOLD, 2**31 - 1))
    return all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)
