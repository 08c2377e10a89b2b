"""
Process-wide memory allocator settings for servers that move data in
MiB buffers.

Why: the hot paths allocate a buffer of about a MiB per socket read, per log
read and per framed batch, and drop it a moment later.  glibc serves such
sizes from fresh C{mmap}s (or trims them off the heap top when freed), so
each one is page-faulted in again, 256 faults a MiB: measured here, decoding
a binary-records body in 1 MiB reads ran at 1 GB/s that way and at 11 GB/s
once freed buffers are kept for reuse.  L{reuse_large_buffers} raises
glibc's mmap and trim thresholds so they are.  The price: up to
C{TRIM_THRESHOLD} bytes of freed memory stay with the process instead of
going back to the kernel.
"""

import ctypes
import ctypes.util

from twisted.logger import Logger

#: allocations up to this size come from the heap (reused when freed)
MMAP_THRESHOLD = 64 * 1024 * 1024
#: free memory at the top of the heap is kept up to this size
TRIM_THRESHOLD = 256 * 1024 * 1024

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_log = Logger()
_done: list[bool] = []


def reuse_large_buffers() -> bool:
    """
    Make glibc keep freed MiB buffers for reuse (see the module docstring).
    Idempotent; a no-op (returning False) where the C library is not glibc.
    twistd servers call it at start-up; a program embedding our factories
    may call it too.
    """
    if _done:
        return _done[0]
    ok = False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        gnu = libc.gnu_get_libc_version      # glibc only
    except (OSError, AttributeError):
        pass
    else:
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
            bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        gnu.restype = ctypes.c_char_p
        _log.debug("glibc {v}: large buffers reused", v=gnu().decode())
    _done.append(ok)
    return ok
