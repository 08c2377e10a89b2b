"""
The one attempt to import the optional C accelerator
(C{streamproto._speedups}): the file store's native fsync threads
(L{streamproto.log.syncer}) and the core kit's framing
(L{streamproto.core.accelerator}, which also tells operators whether it
is loaded) both take it from here, so that one switch turns it off for
all of them.
"""

from __future__ import annotations

import os

#: set (to anything but 0) to run in pure Python although the accelerator
#: is built: benchmarks of the fallback, and operators checking what it costs
PURE_ENV = "STREAMPROTO_PURE_PYTHON"

#: why the import failed (None: it did not)
IMPORT_ERROR: str | None = None

try:
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        raise ImportError(f"disabled by {PURE_ENV}")
    from streamproto import _speedups
    #: the accelerator module, or None (pure Python)
    speedups = _speedups
except ImportError as e:  # no compiler at install time, or a checkout not built
    speedups = None  # type: ignore[assignment]  # the module, or None
    IMPORT_ERROR = str(e) or type(e).__name__
