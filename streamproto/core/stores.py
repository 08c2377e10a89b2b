"""
Which log store a server runs on: the embedded file store under C{--data}
(the default), or a NATS JetStream cluster with C{--store nats://...}
(C{doc/scale-out.rst}).  One set of options for every plugin and the
umbrella, checked before start-up, and one service that owns the store.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Collection, MutableMapping
from typing import Any

from twisted.application import service
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python import usage
from twisted.python.failure import Failure

from streamproto.log.interfaces import ILogStore, IStartingStore
from streamproto.log.storeurl import StoreURL, StoreURLError, is_store_url, parse_store_url

#: a server's parsed options (L{usage.Options}), or a dict of the same keys
Options = MutableMapping[str, Any]

#: the store options every server takes (added to L{ServerOptions})
STORE_PARAMETERS = [
    ["store", None, None,
     "nats://HOST:PORT[,HOST:PORT...][?replicas=N&prefix=P&monitor=HOST:PORT,...] (tls://... "
     "over TLS): keep the logs in a NATS JetStream cluster instead of under --data "
     "(doc/scale-out.rst); monitor: the nodes' monitoring ports, to check sync_interval."],
    ["store-ca", None, None, "CA certificates (PEM) that verify the NATS servers (tls://)."],
    ["store-cert", None, None, "Client certificate (PEM) for NATS servers that require one."],
    ["store-key", None, None, "The private key (PEM) of --store-cert."],
]

#: what an ack means on each store, for the start-up log line
_GUARANTEE = "acknowledged once the cluster's quorum stored it"


def check_store_options(options: Options, local: Collection[str] = ()) -> StoreURL | None:
    """
    Parse C{--store} into C{options["store-url"]} (a L{StoreURL}, or None
    for the file store) and check the TLS files, as usage errors naming the
    option.

    @param local: other values C{--store} takes for a server of its own
        (reliable-stream-server's session stores), left as they are.
    """
    value = options.get("store")
    options["store-url"] = None
    tls_files = {k: options.get(k) for k in ("store-ca", "store-cert", "store-key")}
    if value in local:
        url = None
    elif value is None:
        url = None
    else:
        if not is_store_url(value):
            choices = " or ".join(list(local) + ["nats://HOST:PORT[,...]", "tls://..."])
            raise usage.UsageError(f"--store {value!r}: expected {choices}")
        try:
            url = parse_store_url(value)
        except StoreURLError as e:
            raise usage.UsageError(f"--store {e}")
        try:
            import nats  # noqa: F401
        except ImportError:
            raise usage.UsageError("--store nats://... needs the NATS client: "
                                   "pip install 'streamproto[nats]'")
    if any(tls_files.values()) and (url is None or not url.tls):
        raise usage.UsageError("--store-ca, --store-cert and --store-key go with a "
                               "tls://... --store")
    if bool(tls_files["store-cert"]) != bool(tls_files["store-key"]):
        raise usage.UsageError("give both --store-cert and --store-key, or neither")
    for key, path in tls_files.items():
        if path and not os.access(path, os.R_OK):
            raise usage.UsageError(f"--{key} {path!r}: cannot read it")
    if url is not None and url.tls:
        try:
            store_tls_context(options)
        except (OSError, ssl.SSLError) as e:
            raise usage.UsageError(f"--store {value!r}: the TLS files do not load: {e}")
    options["store-url"] = url
    return url


def store_tls_context(options: Options) -> ssl.SSLContext | None:
    """The C{ssl.SSLContext} of a C{tls://} store (server name checked), or None."""
    url = options.get("store-url")
    if url is None or not url.tls:
        return None
    context = ssl.create_default_context(cafile=options.get("store-ca"))
    if options.get("store-cert"):
        context.load_cert_chain(options["store-cert"], options["store-key"])
    return context


def open_log_store(options: Options, reactor: Any = None, **kwargs: Any) -> ILogStore:
    """
    The log store these (checked) options name: a L{JetStreamLogStore}
    for C{--store nats://...}, else the file store under C{--data}.

    @param reactor: the reactor the store runs on (default: the global one).
    """
    url = options.get("store-url")
    if url is None:
        from streamproto.log import open_store
        if reactor is not None:
            kwargs["reactor"] = reactor
        return open_store(options["data"], **kwargs)
    from streamproto.log.jetstream import JetStreamLogStore
    return JetStreamLogStore(url.servers, replicas=url.replicas, prefix=url.prefix,
                             tls=store_tls_context(options), clock=reactor, monitor=url.monitor)


def describe_store(options: Options) -> str:
    url = options.get("store-url")
    if url is not None:
        return str(url)
    data: str = options["data"]
    return data


class StoreService(service.Service):
    """
    Owns the log store: opened at construction (so factories can be built
    with it), started with the service (a JetStream store connects to its
    cluster: one that cannot be reached is a clean start-up failure of the
    whole server, see L{streamproto.core.tap.ServerService}), and closed
    (fsynced) when the service stops.
    """

    log = Logger()

    def __init__(self, options_or_path: Options | str, **kwargs: Any) -> None:
        from streamproto.core.metrics import observe_store
        if isinstance(options_or_path, str):
            options: Options = {"data": options_or_path, "store-url": None}
        else:
            options = options_or_path
        self.path = describe_store(options)
        #: the file store's data directory (None on JetStream)
        self._directory: str | None = None if options.get("store-url") else options["data"]
        self.store = open_log_store(options, **kwargs)
        observe_store(self.store)

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]  # untyped in Twisted
        if self._directory is not None:
            # a data directory written by a newer release: one clear line
            from streamproto.log.filestore import check_file_store
            from streamproto.log.versions import NewerFormat
            try:
                check_file_store(self._directory)
            except NewerFormat as e:
                cannot_start(self, f"log store {self.path}: {e}")
                return
        if not IStartingStore.providedBy(self.store):
            return
        self.log.info("log store {where}: connecting ({guarantee})", where=self.path,
                      guarantee=_GUARANTEE)
        IStartingStore(self.store).start().addCallbacks(self._started, self._cannot_start)

    def _started(self, _: object) -> None:
        self.log.info("log store {where}: connected", where=self.path)

    def _cannot_start(self, failure: Failure) -> None:
        cannot_start(self, f"log store {self.path} cannot be reached: "
                           f"{failure.getErrorMessage()}")

    def stopService(self) -> Deferred[None]:
        from streamproto.core.metrics import forget_store
        super().stopService()  # type: ignore[no-untyped-call]  # untyped in Twisted
        self.log.info("closing log store {path}", path=self.path)
        forget_store(self.store)
        return self.store.close()


def cannot_start(child: service.IService, message: str) -> None:
    """
    A store C{child} (a service) needs could not be opened after start-up
    began: the whole server stops with one critical line and exit status 1
    when it runs under twistd (L{streamproto.core.tap.ServerService}); an
    embedding application only gets the error line (its C{/ready} reports
    the store).
    """
    top = child.parent
    while top is not None and getattr(top, "parent", None) is not None \
            and hasattr(top.parent, "_cannot_start"):
        top = top.parent
    if top is not None and hasattr(top, "_cannot_start"):
        try:
            top._cannot_start(RuntimeError(message))
            return
        except Exception:  # noqa: BLE001 - not twistd's top service: log it below
            pass
    Logger().error("{message}", message=message)
