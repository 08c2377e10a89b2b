"""
The reactor an object uses when none is given to it: defined in
L{streamproto.base.clock} (the log store, under the core kit, uses it too)
and named here for the protocols.
"""

from streamproto.base.clock import default_reactor

__all__ = ["default_reactor"]
