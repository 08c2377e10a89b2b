"""
The garbage collector's settings for a server process.

Why: CPython's cyclic collector stops everything while it runs, and a
full (generation 2) collection walks every tracked object the process
holds.  Measured on the development machine (doc/performance.rst), a
full collection took about 1 us per object: 80 ms for a freshly started
server (its modules, classes and configuration, about 90,000 objects)
and 180 to 250 ms once 10,000 connections were open, about 24 objects
each.  Every request in flight waits that long: with the default
settings (a full collection considered after every 10 collections of
generation 1) such a pause came every 10 to 30 s while connections were
opening, and it was the p99 of every latency measured then.

L{tune_for_server}, at start-up:

  - raises the number of generation-1 collections before a full one is
    considered from 10 to L{FULL_EVERY} (CPython still waits until the
    objects promoted since the last full one are a quarter of those that
    survived it).  Young collections, which free almost all cyclic
    garbage, run as before; what is left for full collections is what
    survived two young ones (long-lived objects, and cycles that outlive
    their request), so the pause comes about ten times more rarely.  The
    price is memory: such cycles wait longer to be freed.  Measured: a
    styx/0 upgrade leaves its HTTP channel and request in a cycle (about
    30 objects, 1 KB); 9,000 connections opened in a row cost about 4.3
    KB each in RSS instead of 3.4 KB until the next full collection, which
    still comes (after at most 100 collections of generation 1);
  - once the reactor runs (everything imported and configured), collects
    once and freezes what is left (C{gc.freeze}): the process's own
    start-up objects live as long as it does and are never walked again.
    What is frozen is still freed by reference counting; only a cycle
    among start-up objects that later becomes garbage would stay (none is
    expected: they are modules, classes and configuration).

Embedding programs may call it too; it is process-wide.
"""

import gc as _gc
from typing import Any

from twisted.logger import Logger

__all__ = ["FULL_EVERY", "tune_for_server", "freeze_start_up"]

#: generation-1 collections between two full collections considered
#: (CPython's default: 10)
FULL_EVERY = 100

_log = Logger()


def freeze_start_up(gc: Any = _gc) -> int:
    """
    Collect, then freeze every object left (see the module docstring).

    @return: how many objects are frozen.
    """
    gc.collect()
    gc.freeze()
    frozen: int = gc.get_freeze_count()
    _log.info("garbage collector: {n} start-up objects frozen, full collections "
              "considered every {every} generation-1 collections",
              n=frozen, every=gc.get_threshold()[2])
    return frozen


def tune_for_server(reactor: Any, gc: Any = _gc) -> None:
    """
    Apply the server's settings: the thresholds now, the freeze once
    C{reactor} runs (see the module docstring).

    @param reactor: an L{twisted.internet.interfaces.IReactorCore}.
    """
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_EVERY)
    reactor.callWhenRunning(freeze_start_up, gc)
