"""
Whether the optional C accelerator (C{streamproto._speedups}) is loaded:
the one import attempt the framing, the send path and the codecs use
(through L{streamproto.core.framing}), and what every surface that tells
an operator reads (the start-up log line, C{/ready}'s details, the
C{streamproto_accelerator} metric, hence C{streamproto status} and the
status page).

The accelerator is built when the package is installed with a C compiler
(or from a binary wheel: doc/performance.rst).  Without it everything
still works, in pure Python, and silently so until this module: a
checkout run through C{PYTHONPATH} without C{build_ext --inplace}, or an
install on a machine without a compiler, measured half or less of the
throughput and nobody knew why.
"""

from __future__ import annotations

from streamproto.base import speedups as _base

#: set (to anything but 0) to run the record framing paths (and the file
#: store's native fsync threads) in pure Python although the accelerator is
#: built: benchmarks of the fallback, and operators checking what it costs
PURE_ENV = _base.PURE_ENV

#: why the import failed (None: it did not)
IMPORT_ERROR: str | None = _base.IMPORT_ERROR

#: the accelerator module, or None (pure Python): the one import attempt
#: (L{streamproto.base.speedups}).  Tests set it to None to see every
#: surface report the fallback.
speedups = _base.speedups

#: what the pure-Python fallback costs, measured by C{python
#: bench/accel_cost.py} (framing and scanning a batch of 1000 records of
#: 100 B: about 40 times the CPU per record) and by C{python
#: bench/styx_bench.py} with and without C{--pure} (styx/0 consume of
#: 100 B records about 6 times slower, produce about 1.4 times): the
#: figures and commands are in doc/performance.rst
COST = ("record framing and scanning take about 40 times the CPU, and styx/0 "
        "consumes of small records run about 6 times slower (doc/performance.rst)")

#: how to get it
REMEDY = ("install a binary wheel (pip wheel . -w dist/ on a machine with a C compiler), "
          "or build it in a checkout: python setup.py build_ext --inplace")


def accelerated() -> bool:
    """True when the C accelerator is loaded."""
    return speedups is not None


def details() -> dict[str, object]:
    """
    The accelerator's state as JSON-ready data (C{/ready}'s C{details}):
    C{{"loaded": bool, "path": its file or None, "reason": why not or
    None, "cost": what running without it costs or None}}.
    """
    if speedups is not None:
        return {"loaded": True, "path": getattr(speedups, "__file__", None),
                "reason": None, "cost": None}
    return {"loaded": False, "path": None,
            "reason": IMPORT_ERROR or "disabled", "cost": COST}


def warning() -> str | None:
    """One line telling an operator the accelerator is missing, or None when it is loaded."""
    if speedups is not None:
        return None
    return (f"the C accelerator (streamproto._speedups) is not loaded "
            f"({IMPORT_ERROR or 'disabled'}): running in pure Python, where {COST}; "
            f"to get it, {REMEDY}")
