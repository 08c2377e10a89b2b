"""
What every server plugin shares: the core options (C{--port}, repeatable,
and C{--data}) and building listening services from endpoint strings.

A protocol's C{tap.py} subclasses L{ServerOptions} and defines
C{makeService(options, store=None)}; with a store given (the umbrella
C{twistd streamproto}) it shares it, otherwise it opens its own on
C{--data} through L{StoreService}.
"""

import os

from twisted.application import service, strports
from twisted.logger import Logger
from twisted.python import usage


class ServerOptions(usage.Options):
    """Core options.  Subclasses set C{defaultPort} and add their own."""

    defaultPort = None
    optParameters = [
        ["data", "d", "streamproto-data", "Data directory of the embedded log store."],
    ]

    def __init__(self):
        super().__init__()
        self["port"] = []

    def opt_port(self, description):
        """
        Endpoint to listen on (repeatable), e.g. tcp:7123:interface=127.0.0.1,
        ssl:8443:privateKey=key.pem:certKey=cert.pem, or
        mtls:8443:privateKey=key.pem:certKey=cert.pem:caCerts=ca.pem to
        require client certificates.
        """
        self["port"].append(description)

    opt_p = opt_port

    def postOptions(self):
        if not self["port"] and self.defaultPort:
            self["port"] = [self.defaultPort]
        self["data"] = os.path.abspath(self["data"])


def positive_int(name):
    """A coercer for usage.Options that names the option in its error."""
    def coerce(value):
        try:
            v = int(value)
        except ValueError:
            raise ValueError(f"{name} must be an integer")
        if v <= 0:
            raise ValueError(f"{name} must be positive")
        return v
    coerce.coerceDoc = "Positive integer."
    return coerce


class StoreService(service.Service):
    """
    Owns a file-backed log store: opened at construction (so factories can be
    built with it), fsynced and closed when the service stops.
    """

    log = Logger()

    def __init__(self, path, **kwargs):
        from streamproto.log import open_store
        self.path = path
        self.store = open_store(path, **kwargs)

    def stopService(self):
        super().stopService()
        self.log.info("closing log store {path}", path=self.path)
        return self.store.close()


def listen(parent, descriptions, factory):
    """Add one listening service per endpoint description to C{parent}."""
    for description in descriptions:
        strports.service(description, factory).setServiceParent(parent)


def server_service(options, factory_from_store, store=None, name=None):
    """
    The usual shape of a server's C{makeService}: a MultiService owning the
    store (unless one is shared in) and one listener per C{--port}.

    @param factory_from_store: callable(store) -> server protocol factory.
    """
    top = service.MultiService()
    if name:
        top.setName(name)
    if store is None:
        owner = StoreService(options["data"])
        store = owner.store
        # the store must stop after the listeners: MultiService stops its
        # children in reverse order of addition
        owner.setServiceParent(top)
    listen(top, options["port"], factory_from_store(store))
    return top
