"""
C{twistd streamproto}: every server built so far on its default port, over
one embedded log store (one C{--data} for all).
"""

import importlib

from twisted.application import service
from twisted.logger import Logger
from twisted.python import usage

from streamproto.core.tap import StoreService

log = Logger()

# (protocol package, twistd name); a server joins once its tap module exists.
SERVERS = [
    ("styx", "styx-server"),
    ("pravega", "pravega-server"),
    ("lumberjack", "lumberjack-server"),
    ("reliable", "reliable-stream-server"),
    ("relink", "relink-server"),
]


def available_servers():
    """[(name, tap module)] for every server whose tap module imports."""
    found = []
    for package, name in SERVERS:
        try:
            module = importlib.import_module(f"streamproto.{package}.tap")
        except ModuleNotFoundError as e:
            # not built yet; any other missing module is a real error
            if e.name not in (f"streamproto.{package}", f"streamproto.{package}.tap"):
                raise
            continue
        found.append((name, module))
    return found


class Options(usage.Options):
    optParameters = [
        ["data", "d", "streamproto-data", "Data directory shared by every server."],
    ]

    def __init__(self):
        super().__init__()
        self["ports"] = {}

    def opt_listen(self, value):
        """
        NAME=ENDPOINT: listen for server NAME (e.g. styx-server) on ENDPOINT
        instead of its default port (repeatable).
        """
        name, sep, endpoint = value.partition("=")
        if not sep:
            raise usage.UsageError("--listen takes NAME=ENDPOINT")
        self["ports"].setdefault(name, []).append(endpoint)

    def opt_only(self, value):
        """Comma-separated server names to run (default: all)."""
        self["only"] = [v.strip() for v in value.split(",") if v.strip()]

    def postOptions(self):
        known = {name for name, _ in available_servers()}
        for name in list(self["ports"]) + self.get("only", []):
            if name not in known:
                raise usage.UsageError(f"unknown server {name!r}; known: {sorted(known)}")


def makeService(options):
    top = service.MultiService()
    owner = StoreService(options["data"])
    owner.setServiceParent(top)
    only = options.get("only")
    for name, module in available_servers():
        if only and name not in only:
            continue
        sub = module.Options()
        args = ["--data", options["data"]]
        for endpoint in options["ports"].get(name, []):
            args += ["--port", endpoint]
        sub.parseOptions(args)
        module.makeService(sub, store=owner.store).setServiceParent(top)
        log.info("streamproto: {name} on {ports}", name=name, ports=sub["port"])
    return top
