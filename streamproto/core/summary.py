"""
A summary of the suite's Prometheus metrics, and rates between two
summaries: what C{streamproto status} prints and the status page at C{/}
of the metrics site shows (L{streamproto.core.statuspage}); one reading of
the metrics for both.

A summary is plain data (JSON-ready)::

    {"servers": {"styx-server": {"open": 1, "connections": 3, "records_in": 100,
                                 "records_out": 50, "bytes_in": ..., "bytes_out": ...,
                                 "acks": ..., "errors": 0, "pauses": 0}, ...},
     "logs": {"events": {"size": ..., "records": ..., "end": ..., "failed": 0}, ...},
     "fsync": {"count": ..., "sum": ...},
     "accelerated": True}

C{accelerated} is False when the server runs without its C accelerator
(L{streamproto.core.accelerator}), None when its metrics do not say.
"""

from collections.abc import Iterable
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

#: a summary (see the module docstring): plain, JSON-ready data
Summary = dict[str, Any]

#: server counters: sample name -> summary key
SERVER_SAMPLES = {
    "streamproto_connections_open": "open",
    "streamproto_connections_total": "connections",
    "streamproto_records_in_total": "records_in",
    "streamproto_records_out_total": "records_out",
    "streamproto_received_bytes_total": "bytes_in",
    "streamproto_sent_bytes_total": "bytes_out",
    "streamproto_acks_sent_total": "acks",
    "streamproto_backpressure_pauses_total": "pauses",
}
#: summed over the C{code} label
ERROR_SAMPLE = "streamproto_protocol_errors_total"
LOG_SAMPLES = {
    "streamproto_log_size_bytes": "size",
    "streamproto_log_records": "records",
    "streamproto_log_end_position": "end",
    "streamproto_log_failed": "failed",
}
FSYNC_SAMPLES = {
    "streamproto_fsync_seconds_count": "count",
    "streamproto_fsync_seconds_sum": "sum",
}
#: 1 with the C accelerator, 0 in pure Python (streamproto.core.accelerator)
ACCELERATOR_SAMPLE = "streamproto_accelerator"
#: every sample name a summary reads (the dashboard test checks them too)
SAMPLE_NAMES = frozenset(SERVER_SAMPLES) | {ERROR_SAMPLE} | frozenset(LOG_SAMPLES) | frozenset(
    FSYNC_SAMPLES) | {ACCELERATOR_SAMPLE}

#: per-second rates of these server counters
SERVER_RATES = ("records_in", "records_out", "bytes_in", "bytes_out", "errors", "pauses")


def summarise(text: str) -> Summary:
    """
    The summary of a Prometheus text exposition.

    @raise ValueError: C{text} is not the exposition format.
    """
    return summarise_families(text_string_to_metric_families(text))


def summarise_families(families: Iterable[Metric]) -> Summary:
    """The summary of metric families (parsed text, or a registry's C{collect()})."""
    servers: dict[str, dict[str, float]] = {}
    logs: dict[str, dict[str, float]] = {}
    fsync: dict[str, float] = {}
    accelerated: bool | None = None     # None: a server that does not say
    for family in families:
        for s in family.samples:
            name = s.name
            if name in SERVER_SAMPLES:
                servers.setdefault(s.labels.get("server", "?"), {})[SERVER_SAMPLES[name]] = \
                    s.value
            elif name == ERROR_SAMPLE:
                entry = servers.setdefault(s.labels.get("server", "?"), {})
                entry["errors"] = entry.get("errors", 0) + s.value
            elif name in LOG_SAMPLES:
                logs.setdefault(s.labels.get("log", "?"), {})[LOG_SAMPLES[name]] = s.value
            elif name in FSYNC_SAMPLES:
                fsync[FSYNC_SAMPLES[name]] = s.value
            elif name == ACCELERATOR_SAMPLE:
                accelerated = bool(s.value)
    for entry in servers.values():
        for key in SERVER_SAMPLES.values():
            entry.setdefault(key, 0)
        entry.setdefault("errors", 0)
    return {"servers": servers, "logs": logs, "fsync": fsync, "accelerated": accelerated}


def rates(now: Summary, before: Summary | None, elapsed: float | None) -> Summary | None:
    """
    Per-second rates from C{before} to C{now} (summaries C{elapsed}
    seconds apart), or None without a previous summary:

        {"servers": {name: {"records_in": r, ...}},
         "logs": {name: {"records": appended/s, "bytes": growth/s}},
         "fsync_ms": mean fsync latency in the interval (None without fsyncs)}

    A counter that went down (a restarted server) counts from zero.
    """
    if before is None or not elapsed or elapsed <= 0:
        return None

    def delta(a: float, b: float) -> float:
        return a - b if a >= b else a

    servers: dict[str, dict[str, float]] = {}
    for name, s in now.get("servers", {}).items():
        prev = before.get("servers", {}).get(name, {})
        servers[name] = {k: delta(s.get(k, 0), prev.get(k, 0)) / elapsed for k in SERVER_RATES}
    logs: dict[str, dict[str, float]] = {}
    for name, log in now.get("logs", {}).items():
        prev = before.get("logs", {}).get(name)
        if prev is None:
            continue    # new since the last look: no rate yet
        logs[name] = {"records": delta(log.get("end", 0), prev.get("end", 0)) / elapsed,
                      # retention and truncation shrink a log: growth may be negative
                      "bytes": (log.get("size", 0) - prev.get("size", 0)) / elapsed}
    fsync_ms: float | None = None
    f_now, f_before = now.get("fsync", {}), before.get("fsync", {})
    count = delta(f_now.get("count", 0), f_before.get("count", 0))
    if count > 0:
        fsync_ms = 1000.0 * delta(f_now.get("sum", 0), f_before.get("sum", 0)) / count
    return {"servers": servers, "logs": logs, "fsync_ms": fsync_ms}
