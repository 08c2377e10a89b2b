"""
How soon a thread finishing blocking work gets the interpreter back.

Why: without the C accelerator (or with a file layer of the caller's),
the file store's group commit runs C{fsync} in a Python thread
(L{streamproto.log.syncer}); the acknowledgements wait for that thread to
hand its result to the reactor.  (With it, the fsync runs on native
threads that never take the GIL; the SQLite session store and reads that
miss the page cache still use Python threads.)  The thread releases the GIL while in
C{fsync}, but to return it needs the GIL again, and while the reactor
thread is busy (decoding, appending, acking: any load) CPython makes the
thread wait a whole switch interval, 5 ms by default, before the reactor
thread is asked to let go.  A 0.2 ms fsync then cost up to 5 ms per group
commit, every acknowledgement's latency.  L{shorten_switch_interval}
sets L{SWITCH_INTERVAL} (0.5 ms): measured with C{bench/latency.py} at
50% load on styx/0 (three alternated runs each, doc/performance.rst) the
p99 went from 36 / 86 / 82 ms to 13 / 6.9 / 42 ms.  The cost: while two
threads both want the interpreter it changes hands ten times as often
(a few microseconds each); the server's other threads (fsync, SQLite)
mostly wait on the disk.
"""

import sys as _sys
from typing import Any

__all__ = ["SWITCH_INTERVAL", "shorten_switch_interval"]

#: seconds a thread holding the GIL keeps it while another waits
SWITCH_INTERVAL = 0.0005


def shorten_switch_interval(sys: Any = _sys) -> float:
    """
    Set the switch interval to L{SWITCH_INTERVAL}, unless it is already
    shorter (someone chose that).

    @return: the interval before.
    """
    before: float = sys.getswitchinterval()
    if before > SWITCH_INTERVAL:
        sys.setswitchinterval(SWITCH_INTERVAL)
    return before
