"""
Prometheus metrics of a Styx server (C{GET /metrics}).

Each server has its own registry (so that several servers, or tests, in one
process do not collide).  Per-log sizes use the reference's names,
C{log_record_count} and C{log_file_size} with a C{log} label, read from the
store at scrape time.
"""

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily

from streamproto.core import metrics as core_metrics

#: this server's label in the suite-wide metrics (streamproto.core.metrics)
SERVER = "styx-server"

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"



class _LogSizes:
    """A collector reporting a snapshot of log infos taken before a scrape."""

    def __init__(self):
        self.infos = []

    def collect(self):
        count = GaugeMetricFamily("log_record_count", "Current record count", labels=["log"])
        size = GaugeMetricFamily("log_file_size", "Current log file size", labels=["log"])
        end = GaugeMetricFamily("log_end_position", "Synced end position", labels=["log"])
        for info in self.infos:
            count.add_metric([info["name"]], info["record_count"])
            size.add_metric([info["name"]], info["file_size"])
            end.add_metric([info["name"]], info["end_position"])
        return [count, size, end]


class StyxMetrics:
    """
    Counters shared by the HTTP API and the styx/0 / WebSocket streams: the
    reference's (per log, in this server's own registry) and the suite's
    (L{streamproto.core.metrics.ServerMetrics}, as every server).

    @ivar registry: the L{CollectorRegistry} rendered by L{render}.
    @ivar server: the suite-wide metrics of this server.
    """

    def __init__(self, registry=None):
        self.server = core_metrics.ServerMetrics(SERVER)
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.records_produced = Counter(
            "styx_records_produced", "Records appended (acknowledged durable)", ["log"],
            registry=r)
        self.bytes_produced = Counter(
            "styx_bytes_produced", "Record payload bytes appended", ["log"], registry=r)
        self.records_consumed = Counter(
            "styx_records_consumed", "Records sent to consumers", ["log"], registry=r)
        self.bytes_consumed = Counter(
            "styx_bytes_consumed", "Record payload bytes sent to consumers", ["log"],
            registry=r)
        self.http_errors = Counter(
            "styx_http_errors", "HTTP error responses by code", ["code"], registry=r)
        self.active_streams = Gauge(
            "styx_active_streams", "Open consume/produce streams", ["kind"], registry=r)
        self._sizes = _LogSizes()
        r.register(self._sizes)

    def produced(self, log, count, nbytes):
        if count:
            self.records_produced.labels(log).inc(count)
            self.bytes_produced.labels(log).inc(nbytes)
            self.server.records_in.inc(count)

    def consumed(self, log, count, nbytes):
        if count:
            self.records_consumed.labels(log).inc(count)
            self.bytes_consumed.labels(log).inc(nbytes)
            self.server.records_out.inc(count)

    def error(self, code):
        self.http_errors.labels(code).inc()
        self.server.error(code)

    def stream_error(self, name):
        """A styx/0 stream ended with an Error message (C{name}: its ErrorCode name)."""
        self.server.error("styx0_" + name.lower())

    def ack_sent(self):
        """A styx/0 producer stream sent an Ack (one per fsync group, not per record)."""
        self.server.acks.inc()

    def paused(self):
        """A producer stream stopped reading its socket: storage lags."""
        self.server.pauses.inc()

    def forget(self, log):
        """Drop the series of a deleted log."""
        for counter in (self.records_produced, self.bytes_produced, self.records_consumed,
                        self.bytes_consumed):
            try:
                counter.remove(log)
            except KeyError:
                pass

    def render(self, infos):
        """
        The text exposition: this server's metrics (the reference's names,
        with C{infos} (log info dicts) as log sizes), then the suite-wide
        ones (connections, bytes, fsync, store; see doc/operations.rst).
        """
        self._sizes.infos = list(infos)
        try:
            return generate_latest(self.registry) + generate_latest(REGISTRY)
        finally:
            self._sizes.infos = []
