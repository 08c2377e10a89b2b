"""
The Styx sink: C{df.write.format("streamproto")} and
C{df.writeStream.format("streamproto")} append the C{value} column (BINARY
or STRING) of every row to one log of a styx-server.

Each Spark task opens its own producer (styx/0 stream by default, or HTTP
POST with C{protocol=http}) and returns only once the server has
acknowledged every record it sent, i.e. after they were fsynced.  A task
that returns has therefore made its rows durable; a task that fails may
have made part of them durable.

Delivery is at-least-once: Spark retries a failed task (and replays a
micro-batch whose commit was lost), and the retry appends its rows again.
See doc/spark.rst ("Duplicates and how to avoid them").
"""

import socket
import ssl
import time
import urllib.parse

from pyspark.sql.datasource import WriterCommitMessage

from streamproto.spark.remote import StyxHTTPClient, TLSFiles
from streamproto.styx import handshake

try:  # pyspark >= 4.0
    from pyspark.sql.datasource import DataSourceArrowWriter as _BatchWriterBase
except ImportError:  # pragma: no cover
    from pyspark.sql.datasource import DataSourceWriter as _BatchWriterBase
try:  # pyspark >= 4.1
    from pyspark.sql.datasource import DataSourceStreamArrowWriter as _StreamWriterBase
    _STREAM_ARROW = True
except ImportError:  # pragma: no cover
    from pyspark.sql.datasource import DataSourceStreamWriter as _StreamWriterBase
    _STREAM_ARROW = False


class SinkError(Exception):
    """The server refused or broke a stream of records."""


class AppendCommitMessage(WriterCommitMessage):
    """What one task appended: C{count} records, the last ending at C{end_position}."""

    def __init__(self, log, count, end_position):
        self.log = log
        self.count = count
        self.end_position = end_position

    def __repr__(self):
        return f"AppendCommitMessage({self.log!r}, count={self.count}, end={self.end_position})"


class HTTPProducer:
    """Appends with C{POST /logs/{name}/records} (binary-records), one request per chunk."""

    def __init__(self, opts):
        self._client = StyxHTTPClient(opts.url, opts.timeout, opts.tls)
        self._log = opts.log
        self.count = 0
        self.end_position = None

    def send(self, records):
        if not records:
            return
        answer = self._client.append(self._log, records)
        if int(answer.get("count", -1)) != len(records):
            raise SinkError(f"server stored {answer.get('count')} of {len(records)} records")
        self.count += len(records)
        self.end_position = int(answer["position"])

    def finish(self):
        pass

    def close(self):
        pass


class StyxStreamProducer:
    """
    A blocking styx/0 producer (executors have no reactor): an HTTP upgrade
    on C{POST /logs/{name}/records}, then Record messages out and Ack
    messages in.  L{finish} returns once every record sent is acknowledged
    (durable).  Heartbeats go out while waiting, as the protocol requires.

    Between two L{send}s the task may compute for a long time (upstream
    stages) and cannot heartbeat; when a send comes after more than half the
    server's timeout, the producer first waits for every earlier record to be
    acknowledged and opens a new stream, so an idle close by the server never
    leaves records in doubt.

    @ivar count: records sent (over every stream).
    @ivar end_position: the log's synced end in the last Ack.
    """

    def __init__(self, opts):
        from streamproto.styx import codec
        self._codec = codec
        self._opts = opts
        self._timeout = opts.timeout
        self.count = 0
        self.end_position = None
        self._sock = None
        self._open()

    def _open(self):
        codec = self._codec
        self._decoder = codec.StyxDecoder(accept={codec.ACK, codec.HEARTBEAT_TYPE, codec.ERROR})
        self._sent = 0      # records sent on this stream
        self._acked = 0     # records of this stream acknowledged
        self._closed = False
        self._sock = self._connect(self._opts)

    def _connect(self, opts):
        url = urllib.parse.urlsplit(opts.url)
        port = url.port or (443 if url.scheme == "https" else 80)
        sock = socket.create_connection((url.hostname, port), timeout=opts.timeout)
        try:
            if url.scheme == "https":
                context = (opts.tls or TLSFiles()).context()
                sock = context.wrap_socket(sock, server_hostname=url.hostname)
            sock.sendall(handshake.request_head("POST", url.netloc, opts.log,
                                                timeout=max(2, int(opts.timeout)),
                                                base_path=url.path))
            head, rest = self._read_head(sock)
            if not handshake.upgraded(head.status, head.headers):
                raise SinkError(f"styx/0 upgrade refused: HTTP {head.status} "
                                f"{rest[:300]!r}")
            self._heartbeat_every = max(2.0, handshake.remote_timeout(head.headers)) / 2
            self._last_sent = time.monotonic()
            if rest:
                self._handle(self._decoder.feed(rest))
            return sock
        except BaseException:
            sock.close()
            raise

    @staticmethod
    def _read_head(sock):
        """@return: the L{handshake.ResponseHead} and the bytes after it."""
        head = handshake.ResponseHead()
        rest = None
        while rest is None:
            chunk = sock.recv(4096)
            if not chunk:
                raise SinkError("connection closed during the styx/0 handshake")
            try:
                rest = head.feed(chunk)
            except handshake.HandshakeError as e:
                raise SinkError(f"styx/0 handshake: {e}") from None
        return head, rest

    def _handle(self, messages):
        codec = self._codec
        error = None
        for message in messages:
            if isinstance(message, codec.Ack):
                self._acked = message.count
                self.end_position = message.position
            elif isinstance(message, codec.ErrorMessage):
                error = message
        if error is not None:
            # The stream is over.  With every record acknowledged nothing is
            # in doubt (e.g. the server's idle TIMEOUT): the next send opens
            # a new stream.
            self._closed = True
            if self._acked < self._sent:
                raise SinkError(f"styx/0 server error {error.name} with "
                                f"{self._sent - self._acked} records not acknowledged")

    def send(self, records):
        if not records:
            return
        if self._closed or time.monotonic() - self._last_sent >= self._heartbeat_every:
            self.finish()
            self.close()
            self._open()
        self._sock.sendall(self._codec.encode_records(records))
        self._last_sent = time.monotonic()
        self._sent += len(records)
        self.count += len(records)
        self._drain(block=False)

    def _drain(self, block):
        """Read acknowledgements; with C{block}, until every record is acknowledged."""
        sock = self._sock
        deadline = time.monotonic() + self._timeout
        while True:
            if block and self._acked >= self._sent:
                return
            if block:
                now = time.monotonic()
                if now > deadline:
                    raise SinkError(f"only {self._acked} of {self._sent} records acknowledged "
                                    f"after {self._timeout} s")
                if now - self._last_sent >= self._heartbeat_every:
                    sock.sendall(self._codec.HEARTBEAT_BYTES)
                    self._last_sent = now
                sock.settimeout(max(0.05, min(self._heartbeat_every, deadline - now)))
            else:
                sock.settimeout(0)
            try:
                data = sock.recv(65536)
            except (BlockingIOError, socket.timeout, ssl.SSLWantReadError):
                if not block:
                    return
                continue
            finally:
                sock.settimeout(self._timeout)
            if not data:
                self._closed = True
                if self._acked >= self._sent:
                    return
                raise SinkError(f"connection closed with {self._sent - self._acked} records "
                                "not acknowledged")
            self._handle(self._decoder.feed(data))

    def finish(self):
        if self._sent > self._acked:
            self._drain(block=True)

    def close(self):
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass


def open_producer(opts):
    if opts.protocol == "http":
        return HTTPProducer(opts)
    return StyxStreamProducer(opts)


def _check_schema(schema):
    names = [f.name for f in schema.fields]
    if "value" not in names:
        raise ValueError(f"the streamproto sink writes the column 'value', which is not in {names}")
    kind = schema["value"].dataType.typeName()
    if kind not in ("binary", "string"):
        raise ValueError(f"the 'value' column must be BINARY or STRING, not {kind}")


def _arrow_values(batch):
    import pyarrow as pa
    column = batch.column(batch.schema.get_field_index("value"))
    if column.null_count:
        raise ValueError("the streamproto sink cannot write a null value")
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        column = column.cast(pa.binary())
    return column.to_pylist()


def _row_values(rows):
    values = []
    for row in rows:
        value = row["value"]
        if value is None:
            raise ValueError("the streamproto sink cannot write a null value")
        values.append(value.encode("utf-8") if isinstance(value, str) else bytes(value))
    return values


class _Appending:
    def _setup(self, opts, schema, overwrite):
        if overwrite:
            raise ValueError("Styx logs are append-only: use mode('append')")
        _check_schema(schema)
        self.opts = opts
        if opts.create_log:
            StyxHTTPClient(opts.url, opts.timeout, opts.tls).create(opts.log)

    def _append(self, chunks):
        producer = open_producer(self.opts)
        try:
            pending = []
            pending_bytes = 0
            for values in chunks:
                pending.extend(values)
                pending_bytes += sum(map(len, values))
                if len(pending) >= self.opts.batch_records or pending_bytes >= self.opts.batch_bytes:
                    producer.send(pending)
                    pending = []
                    pending_bytes = 0
            producer.send(pending)
            producer.finish()
        finally:
            producer.close()
        return AppendCommitMessage(self.opts.log, producer.count, producer.end_position)


class LogBatchWriter(_Appending, _BatchWriterBase):
    def __init__(self, opts, schema, overwrite):
        self._setup(opts, schema, overwrite)

    def write(self, iterator):
        return self._append(_arrow_values(batch) for batch in iterator)


class LogStreamWriter(_Appending, _StreamWriterBase):
    def __init__(self, opts, schema, overwrite):
        self._setup(opts, schema, overwrite)

    def write(self, iterator):
        if _STREAM_ARROW:
            return self._append(_arrow_values(batch) for batch in iterator)
        return self._append([_row_values(iterator)])  # pragma: no cover

    def commit(self, messages, batchId):
        pass

    def abort(self, messages, batchId):
        # Appended records cannot be taken back; the batch is retried (at-least-once).
        pass
