"""
The reactor an object uses when none is given to it.

Library code takes its reactor (or clock) as an argument, so that a test
can hand it a L{twisted.internet.task.Clock} or a
L{twisted.internet.testing.MemoryReactor}, and so that C{makeService} can
pass down the reactor it was given.  Without one, the global reactor is
imported when it is needed, never when a module is imported: twistd (or
an application) installs the reactor it wants before that.
"""

from typing import Any

__all__ = ["default_reactor"]


def default_reactor(reactor: Any = None) -> Any:
    """
    @param reactor: a reactor or clock, or None.
    @return: C{reactor}, or the global reactor when it is None (any other
        value, such as C{False} for "no reactor", is returned as it is).
    """
    if reactor is None:
        from twisted.internet import reactor as installed
        return installed
    return reactor
