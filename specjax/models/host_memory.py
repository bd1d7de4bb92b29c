"""The host heap while weights load: freed tensor temporaries go back to the OS.

Loading converts one tensor after another (read, cast, transpose), and each step frees buffers of
a few MiB to a few hundred. glibc serves blocks below its mmap threshold from the heap, and that
threshold rises with every large block freed (up to 32 MiB), so the temporaries of a 1.5B model's
load end up as free heap that stays resident: about 1.2 GiB of anonymous memory beside 6.6 GiB of
weights. While `large_blocks_returned()` is active the threshold is fixed at 1 MiB (each larger
block is its own mapping, unmapped when freed); afterwards it is fixed at glibc's dynamic ceiling,
32 MiB, so the decode loop's per-step buffers are reused from the heap as before, and the heap's
free top is trimmed. On a C library without mallopt (not glibc) this changes nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util

_M_MMAP_THRESHOLD = -3        # mallopt parameter (malloc.h)
_WHILE_LOADING = 1 << 20
_AFTER = 32 << 20             # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc


def _libc():
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
  except OSError:
    return None
  return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


@contextlib.contextmanager
def large_blocks_returned():
  """Within: every freed block of 1 MiB or more is returned to the OS at once (module docstring).
  Yields nothing; a no-op where the C library is not glibc."""
  libc = _libc()
  if libc is not None:
    libc.mallopt(_M_MMAP_THRESHOLD, _WHILE_LOADING)
  try:
    yield
  finally:
    if libc is not None:
      libc.mallopt(_M_MMAP_THRESHOLD, _AFTER)
      libc.malloc_trim(0)
