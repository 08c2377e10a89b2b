"""
Prometheus metrics shared by every server, defined once (prometheus_client
refuses to register a name twice) and labelled by server.

Protocols count what only they know (records, acks, errors by code);
connections and bytes are counted for them by
L{streamproto.core.ops.TrackingFactory}; the log store is observed through
L{observe_store} at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric

from streamproto.core import accelerator
from streamproto.log.metrics import FSYNC_SECONDS, GROUP_COMMIT_APPENDS, RETENTION_DELETIONS

if TYPE_CHECKING:
    from streamproto.log.interfaces import ILogStore

__all__ = [
    "ACKS_SENT", "AUTH_DENIED", "BACKPRESSURE_PAUSES", "BYTES_IN", "BYTES_OUT",
    "CONNECTIONS_OPEN", "CONNECTIONS_TOTAL", "ERRORS", "FSYNC_SECONDS",
    "GROUP_COMMIT_APPENDS", "RECORDS_IN", "RECORDS_OUT", "RETENTION_DELETIONS",
    "STORES", "ServerMetrics", "StoreCollector", "forget_store", "observe_store",
]

CONNECTIONS_OPEN = Gauge(
    "streamproto_connections_open", "Connections open now.", ["server"])
CONNECTIONS_TOTAL = Counter(
    "streamproto_connections", "Connections accepted.", ["server"])
BYTES_IN = Counter("streamproto_received_bytes", "Bytes received.", ["server"])
BYTES_OUT = Counter("streamproto_sent_bytes", "Bytes sent.", ["server"])
RECORDS_IN = Counter(
    "streamproto_records_in", "Records, events or messages received and stored.", ["server"])
RECORDS_OUT = Counter(
    "streamproto_records_out", "Records, events or messages sent to clients.", ["server"])
ACKS_SENT = Counter("streamproto_acks_sent", "Acknowledgements sent.", ["server"])
ERRORS = Counter(
    "streamproto_protocol_errors", "Protocol errors sent or connections closed for bad input.",
    ["server", "code"])
BACKPRESSURE_PAUSES = Counter(
    "streamproto_backpressure_pauses",
    "Times a connection's reading was paused because storage lagged.", ["server"])
AUTH_DENIED = Counter(
    "streamproto_auth_denied", "Requests denied by the authorization policy (doc/security.rst).",
    ["server", "op"])
ACCELERATOR = Gauge(
    "streamproto_accelerator",
    "1 when the C accelerator (streamproto._speedups) is loaded, 0 when running in pure Python.")
# read at every scrape: what streamproto.core.accelerator says now
ACCELERATOR.set_function(lambda: 1.0 if accelerator.accelerated() else 0.0)


class ServerMetrics:
    """
    One server's share of the suite-wide metrics: the children labelled
    with its name, looked up once (C{labels()} costs a lock and a dict
    lookup; a protocol counts on its hot path).  Every server factory holds
    one as C{metrics}.
    """

    def __init__(self, server: str) -> None:
        self.server = server
        self.records_in = RECORDS_IN.labels(server)
        self.records_out = RECORDS_OUT.labels(server)
        self.acks = ACKS_SENT.labels(server)
        self.pauses = BACKPRESSURE_PAUSES.labels(server)
        self._errors: dict[str, Counter] = {}

    def error(self, code: str) -> None:
        """Count one protocol error (an error reply, or a connection closed) of kind C{code}."""
        counter = self._errors.get(code)
        if counter is None:
            counter = self._errors[code] = ERRORS.labels(self.server, code)
        counter.inc()


class StoreCollector:
    """Per-log sizes and positions, read from the open stores at scrape time."""

    def __init__(self) -> None:
        self.stores: list[ILogStore] = []

    def collect(self) -> Iterable[Metric]:
        size = GaugeMetricFamily("streamproto_log_size_bytes", "Bytes on disk per log.",
                                 labels=["log"])
        records = GaugeMetricFamily("streamproto_log_records", "Readable records per log.",
                                    labels=["log"])
        end = GaugeMetricFamily("streamproto_log_end_position", "Synced end position per log.",
                                labels=["log"])
        failed = GaugeMetricFamily("streamproto_log_failed",
                                   "1 if the log fail-stopped or is corrupt.", labels=["log"])
        for store in list(self.stores):
            for log in store.open_logs():
                info = log.info()
                size.add_metric([info["name"]], info["file_size"])
                records.add_metric([info["name"]], info["record_count"])
                end.add_metric([info["name"]], info["end_position"])
                failed.add_metric([info["name"]], 0 if info["status"] == "ok" else 1)
        return [size, records, end, failed]


STORES = StoreCollector()
REGISTRY.register(STORES)


def observe_store(store: ILogStore) -> None:
    """Report C{store}'s open logs in the metrics (until L{forget_store})."""
    if store not in STORES.stores:
        STORES.stores.append(store)


def forget_store(store: ILogStore) -> None:
    if store in STORES.stores:
        STORES.stores.remove(store)
