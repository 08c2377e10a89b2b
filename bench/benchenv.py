"""
Which streamproto a benchmark measures, said before it measures anything.

Every benchmark here runs the checkout (C{ROOT} first on C{sys.path}, and
C{PYTHONPATH=ROOT} for the servers it starts).  A fresh clone has no C
accelerator built there, and without it C{streamproto._speedups} silently
falls back to pure Python: a benchmark would then measure the fallback
and nobody would know.  L{measured}, called by each benchmark before it
imports streamproto:

  - builds the accelerator in place (C{setup.py build_ext --inplace}) when
    the checkout has none;
  - refuses to go on (exit status 2) when it still cannot be imported,
    unless pure Python is asked for (C{STREAMPROTO_PURE_PYTHON=1}, or a
    benchmark's own C{--pure});
  - prints one line saying which package it measures and which path
    (C accelerator, with its file, or pure Python).

With pure Python asked for, C{STREAMPROTO_PURE_PYTHON=1} is set in the
environment, so the servers a benchmark starts run without it too
(L{streamproto.core.accelerator}).
"""

import importlib
import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PURE_ENV = "STREAMPROTO_PURE_PYTHON"
_said = []      # the line printed, once measured() ran


def _find():
    """(the streamproto package directory, the accelerator's file or None)."""
    importlib.invalidate_caches()
    spec = importlib.util.find_spec("streamproto._speedups")
    package = os.path.dirname(importlib.util.find_spec("streamproto").origin)
    return package, (spec.origin if spec is not None else None)


def _build():
    """Build the accelerator in the checkout; its output goes to stderr."""
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=ROOT,
                   stdout=sys.stderr, stderr=sys.stderr, check=False)


def measured(pure=None, out=None):
    """
    Make sure the path a benchmark measures is the one it means, and say
    which (see the module docstring).

    @param pure: measure pure Python (default: C{STREAMPROTO_PURE_PYTHON}).
    @return: the line printed.
    """
    if _said and pure is None:
        return _said[0]     # a benchmark importing another: said once
    out = out or sys.stdout
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    if pure is None:
        pure = os.environ.get(PURE_ENV, "") not in ("", "0")
    package, accel = _find()
    where = "checkout" if os.path.dirname(package) == ROOT else "installed"
    if pure:
        os.environ[PURE_ENV] = "1"      # the servers this benchmark starts, too
        line = f"measuring streamproto ({where}, {package}): pure Python ({PURE_ENV}=1)"
    else:
        if accel is None and where == "checkout":
            print(f"bench: no C accelerator in {package}: building it in place",
                  file=sys.stderr)
            _build()
            package, accel = _find()
        if accel is None:
            sys.stderr.write(
                f"bench: streamproto ({where}, {package}) has no C accelerator "
                "(streamproto._speedups), and a benchmark of the pure-Python fallback "
                "by accident measures the wrong thing: install a C compiler (or a binary "
                f"wheel, doc/performance.rst), or set {PURE_ENV}=1 to measure pure "
                "Python on purpose\n")
            raise SystemExit(2)
        line = f"measuring streamproto ({where}, {package}): C accelerator ({accel})"
    print(line, file=out, flush=True)
    _said[:] = [line]
    return line
