"""
Where the logs are: a local log store directory or styx-servers.

Both give the same two things: the readable bounds of each log (on the
driver, to plan offsets) and the records of a range as L{RecordBatch}es (on
the executors).  Nothing here keeps a file or socket open between calls, so
readers and partitions pickle cleanly.
"""

import functools
from dataclasses import dataclass
from urllib.parse import urlsplit

from twisted.logger import Logger

from streamproto.log.errors import LogNotFound, PositionOutOfRange
from streamproto.log.public import is_internal
from streamproto.spark.planning import node_key
from streamproto.spark.remote import StyxHTTPClient, StyxHTTPError


_logger = Logger()


class DataLossError(Exception):
    """
    A range to read is no longer (or not yet) in the log: retention or a
    truncation removed records that a query had not read yet.
    """


class AmbiguousLogError(Exception):
    """A log of the same name is on several of the servers given."""


@dataclass(frozen=True)
class Location:
    """
    C{kind} is C{"path"} (a store directory), C{"url"} (a styx-server) or
    C{"nats"} (a JetStream store URL).
    """

    kind: str
    where: str


class LocalLogs:
    """The logs of a store directory, read with the store's synchronous reader."""

    def __init__(self, path):
        from streamproto.log.reader import LogDirectoryReader
        self.path = path
        self._reader = LogDirectoryReader(path)

    def bounds(self, logs=None, missing_ok=False):
        """
        @return: C{{log: (start_position, end_position)}} and C{{log: Location}}.
        """
        return _reader_bounds(self._reader, Location("path", self.path), logs, missing_ok)


def _reader_bounds(reader, where, logs, missing_ok):
    """The bounds of C{logs} (every user's log when None) of a synchronous reader."""
    # every log: the users' logs, not the servers' internal state
    names = [n for n in reader.names() if not is_internal(n)] if logs is None else logs
    bounds = {}
    for name in names:
        try:
            bounds[name] = reader.bounds(name)
        except LogNotFound:
            if not missing_ok:
                raise
    return bounds, {name: where for name in bounds}


class RemoteLogs:
    """
    The logs of one or several styx-servers.  With C{fleet}, the same log
    name on several servers is one stream per node: the keys of the bounds
    are C{"host:port/log"} (L{node_key}); without, a log name must be on one
    server only.
    """

    def __init__(self, urls, timeout, tls=None, fleet=False):
        self.clients = [StyxHTTPClient(url, timeout, tls) for url in urls]
        self.fleet = fleet

    def bounds(self, logs=None, missing_ok=False):
        bounds = {}
        where = {}
        found = set()
        wanted = None if logs is None else set(logs)
        for client in self.clients:
            if wanted is not None and len(self.clients) == 1:
                names = list(logs)
            else:
                names = [n for n in client.names() if wanted is None or n in wanted]
            for name in names:
                try:
                    start, end = client.bounds(name)
                except StyxHTTPError as e:
                    if e.status == 404 or e.code == "log_not_found":
                        continue
                    raise
                found.add(name)
                key = node_key(urlsplit(client.base_url).netloc, name) if self.fleet else name
                if key in where:
                    raise AmbiguousLogError(
                        f"log {name!r} is on both {where[key].where} and {client.base_url}: "
                        "name the logs to read with the option 'logs'")
                bounds[key] = (start, end)
                where[key] = Location("url", client.base_url)
        if not missing_ok and wanted is not None:
            missing = sorted(wanted - found)
            if missing:
                raise LogNotFound(f"log(s) {', '.join(missing)} not found on "
                                  f"{', '.join(c.base_url for c in self.clients)}")
        return bounds, where


class SyncedLocalLogs:
    """
    The logs of a store directory, bounded by what its styx-server reports
    as synced: executors read the files, but never past an end that a power
    failure could still take back.
    """

    def __init__(self, path, url, timeout, tls=None):
        self.path = path
        self._server = RemoteLogs([url], timeout, tls)

    def bounds(self, logs=None, missing_ok=False):
        bounds, _ = self._server.bounds(logs, missing_ok)
        where = Location("path", self.path)
        return bounds, {name: where for name in bounds}


class JetStreamLogs:
    """The logs of a JetStream store, read straight from the cluster."""

    def __init__(self, store, timeout, tls=None):
        self.store = store
        self._reader = _jetstream_reader(store, timeout, tls)

    def bounds(self, logs=None, missing_ok=False):
        return _reader_bounds(self._reader, Location("nats", self.store), logs, missing_ok)


def _jetstream_reader(store, timeout, tls):
    from streamproto.log.natsreader import JetStreamReader
    from streamproto.log.storeurl import parse_store_url
    url = parse_store_url(store)
    context = tls.context() if (tls is not None and url.tls) else None
    return JetStreamReader(url.servers, prefix=url.prefix, tls=context, timeout=timeout)


def open_logs(opts):
    """Where the logs of these L{SourceOptions} are, and how to find their bounds."""
    if opts.store is not None:
        return JetStreamLogs(opts.store, opts.timeout, opts.tls)
    if opts.path is not None and opts.urls:
        return SyncedLocalLogs(opts.path, opts.urls[0], opts.timeout, opts.tls)
    if opts.path is not None:
        return LocalLogs(opts.path)
    return RemoteLogs(opts.urls, opts.timeout, opts.tls, fleet=opts.fleet)


def read_range(location, log, start, end, fail_on_data_loss=True, timeout=30.0,
               max_bytes=8 * 1024 * 1024, tls=None, with_time=False):
    """
    Yield L{RecordBatch}es covering C{[start, end)} of C{log} (executor side).

    @param with_time: yield C{(batch, append time in microseconds)} pairs
        instead; only a JetStream store (C{nats}) keeps that time.

    @raise DataLossError: if records of the range were removed (by retention
        or truncation) and C{fail_on_data_loss}; otherwise the missing head is
        skipped.
    """
    if start >= end:
        return
    if with_time and location.kind != "nats":
        raise ValueError("only a JetStream store keeps an append time per batch")
    if location.kind == "path":
        from streamproto.log.reader import LogDirectoryReader
        source = LogDirectoryReader(location.where)
        read = functools.partial(source.read, max_bytes=max_bytes)
    elif location.kind == "nats":
        source = _jetstream_reader(location.where, timeout, tls)
        read = functools.partial(source.read, max_bytes=max_bytes, with_time=with_time)
    else:
        source = StyxHTTPClient(location.where, timeout, tls)
        read = source.read
        # One HTTP round trip to tell data loss from a server error up front.
        start = _check_range(source, log, start, end, fail_on_data_loss)
    try:
        batches = read(log, start, end)
        first = next(batches, None)
    except PositionOutOfRange:
        # Local reads find out here (asking for the bounds first would scan
        # the log's last segment twice per task).
        start = _check_range(source, log, start, end, fail_on_data_loss)
        if start >= end:
            return
        batches = read(log, start, end)
        first = next(batches, None)
    if first is not None:
        yield first
        yield from batches


def _check_range(source, log, start, end, fail_on_data_loss):
    """C{start}, or where to start when records were lost and that is allowed."""
    first, last = source.bounds(log)
    if end > last:
        raise DataLossError(f"log {log!r}: records up to {end} were planned but the log ends "
                            f"at {last} (was it deleted and recreated?)")
    if start < first:
        if fail_on_data_loss:
            raise DataLossError(
                f"log {log!r}: records [{start}, {min(first, end)}) were removed before they "
                "were read (retention or truncation); set failOnDataLoss=false to skip them")
        _logger.warn("log {name}: records [{start}, {first}) were removed before they were "
                     "read; skipping them (failOnDataLoss=false)", name=log, start=start,
                     first=min(first, end))
        return min(first, end)
    return start
