"""
A blocking client for styx-server's HTTP API, for Spark executors (which
have no reactor): plain C{urllib.request}.

Reads use C{GET /logs/{name}/records?whence=origin&position=P&count=N} with
C{Accept: application/vnd.styx.binary-records} (int32 big-endian size, then
the bytes, repeated), decoded incrementally into L{RecordBatch}es so that
memory stays bounded whatever the record sizes.
"""

import json
import ssl
import struct
import urllib.error
import urllib.parse
import urllib.request

from dataclasses import dataclass

from streamproto.core.framing import TOO_LARGE, frame_records, scan_frames
from streamproto.log.batch import RecordBatch, lengths_array

BINARY_RECORDS = "application/vnd.styx.binary-records"

_SIZE = struct.Struct(">i")

#: Styx's default (and largest sensible) record size; a size prefix above it
#: means the stream is not binary-records.
DEFAULT_MAX_RECORD_SIZE = 64 * 1024 * 1024

_READ_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class TLSFiles:
    """
    PEM files for C{https://} servers (paths: they must exist wherever the
    connection is made, executors included).  Without C{ca_certs} the
    system's CAs verify the server; C{certificate} and C{private_key} are the
    client's, for servers that require one (mTLS).
    """

    ca_certs: str | None = None
    certificate: str | None = None
    private_key: str | None = None

    def context(self):
        context = ssl.create_default_context(cafile=self.ca_certs)
        if self.certificate:
            context.load_cert_chain(self.certificate, self.private_key)
        return context


class StyxHTTPError(Exception):
    """
    styx-server answered with an error.

    @ivar status: the HTTP status (0 when the server could not be reached).
    @ivar code: Styx's error code (e.g. C{"log_not_found"}), or None.
    """

    def __init__(self, url, status, code=None, message=""):
        super().__init__(f"{url}: HTTP {status} {code or ''} {message}".strip())
        self.url = url
        self.status = status
        self.code = code


class BinaryRecordsError(ValueError):
    """Bytes that are not a valid binary-records stream."""


class BinaryRecordsDecoder:
    """
    Sans-IO decoder of C{application/vnd.styx.binary-records}: feed bytes as
    they come, take whole records out as a L{RecordBatch}.
    """

    def __init__(self, position=0, max_record_size=DEFAULT_MAX_RECORD_SIZE):
        self.position = position
        self.max_record_size = max_record_size
        self._buffer = bytearray()

    @property
    def pending(self):
        """Bytes received that do not make a whole record yet."""
        return len(self._buffer)

    def feed(self, data):
        """
        @return: a L{RecordBatch} of the records completed by C{data} (maybe empty).
        @raise BinaryRecordsError: on a negative or oversized size prefix.
        """
        buffer = self._buffer
        buffer += data
        # the shared framing (C accelerated): sizes + one buffer of payloads
        lengths, payload, end, status = scan_frames(buffer, 0, b"", self.max_record_size)
        if status == TOO_LARGE:
            (size,) = _SIZE.unpack_from(buffer, end)
            raise BinaryRecordsError(f"bad record size {size} in binary-records stream")
        del buffer[:end]
        batch = RecordBatch(self.position, lengths, payload)
        self.position += len(lengths)
        return batch


def encode_binary_records(records):
    """The binary-records body for C{records} (a sequence of bytes-like objects)."""
    records = list(records)
    return frame_records(lengths_array(map(len, records)), b"".join(records), b"")


class StyxHTTPClient:
    """One styx-server, by base URL (C{http://host:port})."""

    def __init__(self, base_url, timeout=30.0, tls=None):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.tls = tls
        self._context = None

    def _url(self, path, query=None):
        url = self.base_url + path
        if query:
            url += "?" + urllib.parse.urlencode(query)
        return url

    def _open(self, request):
        if self.base_url.startswith("https:") and self._context is None:
            self._context = (self.tls or TLSFiles()).context()
        try:
            return urllib.request.urlopen(request, timeout=self.timeout, context=self._context)
        except urllib.error.HTTPError as e:
            code = message = None
            try:
                body = json.loads(e.read() or b"{}")
                code, message = body.get("code"), body.get("message", "")
            except (ValueError, AttributeError):
                pass
            finally:
                e.close()
            raise StyxHTTPError(request.full_url, e.code, code, message or "")
        except urllib.error.URLError as e:
            raise StyxHTTPError(request.full_url, 0, None, str(e.reason))
        except OSError as e:  # TLS alerts (e.g. certificate required), resets
            raise StyxHTTPError(request.full_url, 0, None, str(e))

    def _json(self, request):
        with self._open(request) as response:
            return json.loads(response.read())

    def names(self):
        """The names of the server's logs."""
        listing = self._json(urllib.request.Request(self._url("/logs")))
        return sorted(entry["name"] if isinstance(entry, dict) else entry for entry in listing)

    def info(self, name):
        """The log info dict (C{start_position}, C{end_position}, ...)."""
        quoted = urllib.parse.quote(name, safe="")
        return self._json(urllib.request.Request(self._url(f"/logs/{quoted}")))

    def bounds(self, name):
        info = self.info(name)
        return int(info["start_position"]), int(info["end_position"])

    def create(self, name):
        """Create a log; an existing one is fine."""
        body = urllib.parse.urlencode({"name": name}).encode()
        request = urllib.request.Request(
            self._url("/logs"), data=body, method="POST",
            headers={"Content-Type": "application/x-www-form-urlencoded"})
        try:
            self._json(request)
        except StyxHTTPError as e:
            if e.code != "log_exist" and e.status != 409:
                raise

    def read(self, name, start, end, max_record_size=DEFAULT_MAX_RECORD_SIZE):
        """
        Records C{[start, end)} of a log, as L{RecordBatch}es of at most about
        1 MiB each.  The server may end a response early (it returns as soon
        as it would block); reading goes on from where it stopped.

        @raise StyxHTTPError: if the server fails, or has fewer records than asked.
        """
        quoted = urllib.parse.quote(name, safe="")
        position = start
        while position < end:
            request = urllib.request.Request(
                self._url(f"/logs/{quoted}/records",
                          {"whence": "origin", "position": position, "count": end - position}),
                headers={"Accept": BINARY_RECORDS})
            decoder = BinaryRecordsDecoder(position, max_record_size)
            with self._open(request) as response:
                while decoder.position < end:
                    chunk = response.read(_READ_CHUNK)
                    if not chunk:
                        break
                    batch = decoder.feed(chunk)
                    if len(batch):
                        if batch.next_position > end:
                            raise BinaryRecordsError(
                                f"{name}: server sent records past position {end}")
                        yield batch
            if decoder.pending:
                raise BinaryRecordsError(f"{name}: response ended inside a record")
            if decoder.position == position:
                raise StyxHTTPError(request.full_url, 200, "short_read",
                                    f"no record at position {position} (log end moved back?)")
            position = decoder.position

    def append(self, name, records):
        """
        POST records (one binary-records body).  The server answers after the
        fsync, so a return means the records are durable.

        @return: the server's answer, C{{"position": first, "count": n}}.
        """
        body = encode_binary_records(records)
        quoted = urllib.parse.quote(name, safe="")
        request = urllib.request.Request(
            self._url(f"/logs/{quoted}/records"), data=body, method="POST",
            headers={"Content-Type": BINARY_RECORDS, "Content-Length": str(len(body))})
        return self._json(request)
