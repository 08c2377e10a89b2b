"""
Deferreds waiting for something to happen: defined in
L{streamproto.base.observer} (the log store, under the core kit, uses them
too) and named here for the protocols.
"""

from streamproto.base.observer import Observers, OneShotObserver, SharedCall

__all__ = ["Observers", "OneShotObserver", "SharedCall"]
