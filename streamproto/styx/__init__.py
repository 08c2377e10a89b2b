"""
Styx: the HTTP API (L{streamproto.styx.resource}) and the styx/0 binary
stream protocol over the same port, backed by the embedded log store.

The clients are importable from here (loaded on first use, so that
importing a light module such as L{streamproto.styx.params} stays light)::

    from streamproto.styx import StyxClient, StyxProducer, StyxConsumer
"""

import importlib

_LAZY = {
    "StyxClient": "streamproto.styx.api_client",
    "StyxAPIError": "streamproto.styx.api_client",
    "StyxProducer": "streamproto.styx.stream_client",
    "StyxConsumer": "streamproto.styx.stream_client",
    "make_site": "streamproto.styx.resource",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'streamproto.styx' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
