"""Tests for L{streamproto.core.memory}."""

import ctypes
import ctypes.util
import subprocess
import sys

from twisted.trial import unittest

from streamproto.core import memory


class ReuseLargeBuffersTests(unittest.SynchronousTestCase):
    def test_idempotent(self):
        first = memory.reuse_large_buffers()
        self.assertEqual(memory.reuse_large_buffers(), first)

    def test_glibc_settings_take(self):
        """
        On glibc the thresholds are set: a MiB allocated, freed and
        allocated again comes back from the heap (the same address) rather
        than from a new mapping.
        """
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            getattr(libc, "gnu_get_libc_version")  # noqa: B009 - AttributeError: not glibc
        except (OSError, AttributeError):
            raise unittest.SkipTest("not glibc: the call is documented as a no-op there")
        code = (
            "import ctypes, ctypes.util, sys\n"
            "sys.path.insert(0, %r)\n"
            "from streamproto.core.memory import reuse_large_buffers\n"
            "libc = ctypes.CDLL(ctypes.util.find_library('c') or 'libc.so.6')\n"
            "libc.malloc.restype = ctypes.c_void_p\n"
            "libc.free.argtypes = [ctypes.c_void_p]\n"
            "def fresh():\n"
            "    a = libc.malloc(1 << 20); libc.free(a); b = libc.malloc(1 << 20); libc.free(b)\n"
            "    return a == b\n"
            "print(reuse_large_buffers(), fresh())\n" % (sys.path[0] or ".",))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout.split()
        self.assertEqual(out, ["True", "True"])
