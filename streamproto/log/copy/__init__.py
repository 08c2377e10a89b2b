"""
Copying logs between stores (C{streamproto store copy}): every log with
the same positions, offsets, record boundaries and attributes, resumable,
verified, and, with C{follow}, kept up to date until a cut-over
(doc/scale-out.rst).

L{plan} decides (pure), L{engine} copies one log, L{store} a whole store.
"""

from streamproto.log.copy.engine import CopyFailed, LogCopy
from streamproto.log.copy.plan import JOURNAL_LOG, CopyRefused, Digest, select
from streamproto.log.copy.store import SourceWritten, StoreCopy, last_journal_entry

__all__ = ["CopyFailed", "CopyRefused", "Digest", "JOURNAL_LOG", "LogCopy", "SourceWritten",
           "StoreCopy", "last_journal_entry", "select"]
