"""
The Styx HTTP API (streamproto.styx.resource) on a real Site over
127.0.0.1, every route and error, the three body formats both ways,
long-polls, backpressure on slow consumers, bounded bodies, TLS.
"""

import io
import json
import os
import struct
import tarfile
import tempfile

import treq
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import defer, protocol, reactor, task
from twisted.internet.endpoints import serverFromString
from twisted.trial import unittest
from twisted.web.client import HTTPConnectionPool

from streamproto.log import LogConfig, MemoryLogStore, open_store
from streamproto.styx import formats
from streamproto.styx.errors import CODES, APIError, from_exception
from streamproto.styx.params import ReadParams, parse_read_params
from streamproto.styx.resource import StyxResource, make_site
from test.support.tlsutil import certs

LINES = "application/vnd.styx.line-delimited"
BINARY = "application/vnd.styx.binary-records"


def binary(records):
    return b"".join(struct.pack(">i", len(r)) + r for r in records)


def unbinary(body):
    out, pos = [], 0
    while pos < len(body):
        (n,) = struct.unpack_from(">i", body, pos)
        out.append(body[pos + 4:pos + 4 + n])
        pos += 4 + n
    return out


class RawHTTP(protocol.Protocol):
    """Sends raw bytes, collects everything until the server closes."""

    def __init__(self, request):
        self.request = request
        self.data = bytearray()
        self.done = defer.Deferred()

    def connectionMade(self):
        self.transport.write(self.request)

    def dataReceived(self, data):
        self.data += data

    def connectionLost(self, reason):
        self.done.callback(bytes(self.data))


def records_post(body, content_type=BINARY, length=None, close=True):
    """
    The raw bytes of a POST of C{body} to C{/logs/events/records}.

    @param content_type: its Content-Type, or None for none.
    @param length: a Content-Length other than the body's (a body cut short).
    @param close: ask the server to close the connection after its answer.
    """
    head = b"POST /logs/events/records HTTP/1.1\r\nHost: x\r\n"
    if close:
        head += b"Connection: close\r\n"
    if content_type is not None:
        head += b"Content-Type: " + content_type.encode() + b"\r\n"
    return head + b"Content-Length: %d\r\n\r\n" % (
        len(body) if length is None else length) + body


class WatchedStore:
    """Delegates to a store; records the wait() Deferreds of its logs' readers."""

    def __init__(self, store):
        self.store = store
        self.waits = []
        self.cancelled = []
        self.reads = 0
        self.read_bytes = 0
        self.waiting = defer.Deferred()

    def __getattr__(self, name):
        return getattr(self.store, name)

    def get(self, name):
        return self.store.get(name).addCallback(WatchedLog, self)


class WatchedLog:
    def __init__(self, log, watcher):
        self._log = log
        self._watcher = watcher

    def __getattr__(self, name):
        return getattr(self._log, name)

    def read(self, *args, **kwargs):
        def count(batch):
            self._watcher.reads += 1
            self._watcher.read_bytes += batch.nbytes
            return batch
        return self._log.read(*args, **kwargs).addCallback(count)

    def wait(self, position, timeout=None):
        d = self._log.wait(position, timeout)

        def seen(failure):
            self._watcher.cancelled.append(failure.check(defer.CancelledError))
            return failure
        d.addErrback(seen)
        self._watcher.waits.append((d, timeout))
        waiting, self._watcher.waiting = self._watcher.waiting, defer.Deferred()
        waiting.callback(d)
        return d


class HTTPTestBase(unittest.TestCase):
    timeout = 30
    max_body_size = 64 * 1024 * 1024

    def setUp(self):
        # the store's clock times long-poll waits: the tests drive it
        self.clock = task.Clock()
        self.memory = MemoryLogStore(self.clock)
        self.store = WatchedStore(self.memory)
        self.upgrades = []
        self.site = make_site(self.store, max_body_size=self.max_body_size,
                              default_config=LogConfig(max_record_size=4096),
                              upgrade=self.fake_upgrade)
        self.port = reactor.listenTCP(0, self.site, interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)
        self.base = f"http://127.0.0.1:{self.port.getHost().port}"
        self.pool = HTTPConnectionPool(reactor, persistent=True)
        self.addCleanup(self.pool.closeCachedConnections)

    def fake_upgrade(self, request, log, params, **kwargs):
        self.upgrades.append((request.method, log.name, params, kwargs))
        request.setResponseCode(418)
        request.write(b"upgraded")
        request.finish()

    def url(self, path):
        return self.base + path

    @defer.inlineCallbacks
    def call(self, method, path, body=None, headers=None, data=None):
        response = yield treq.request(method, self.url(path), data=data if data is not None
                                      else body, headers=headers, pool=self.pool)
        content = yield response.content()
        return response, content

    @defer.inlineCallbacks
    def assertError(self, method, path, status, code, **kwargs):
        response, content = yield self.call(method, path, **kwargs)
        self.assertEqual(response.code, status, content)
        self.assertEqual(response.headers.getRawHeaders("content-type"), ["application/json"])
        error = json.loads(content)
        self.assertEqual(error["code"], code)
        self.assertIsInstance(error["message"], str)
        return error

    def open_raw(self, data):
        """
        Send C{data} on a new connection to the server.

        @return: Deferred firing with the L{RawHTTP} once connected (its
            C{done} fires with the whole answer).
        """
        return protocol.ClientCreator(reactor, RawHTTP, data).connectTCP(
            "127.0.0.1", self.port.getHost().port)

    @defer.inlineCallbacks
    def raw(self, data):
        proto = yield self.open_raw(data)
        response = yield proto.done
        return response

    @defer.inlineCallbacks
    def make_log(self, name="events", records=(), **form):
        form["name"] = name
        response, content = yield self.call("POST", "/logs", data=form)
        self.assertEqual(response.code, 200, content)
        if records:
            log = yield self.memory.get(name)
            yield log.append(list(records))
        return json.loads(content)


class ErrorTests(unittest.SynchronousTestCase):
    def test_reference_codes_and_statuses(self):
        expected = {
            "unknown_error": 500, "method_not_allowed": 405, "not_found": 404,
            "invalid_params": 400, "log_exist": 400, "log_not_found": 404,
            "log_not_available": 400, "log_invalid_name": 400, "missing_content_length": 400,
            "record_too_large": 400, "request_too_large": 413,
        }
        for code, status in expected.items():
            self.assertEqual(CODES[code][0], status, code)
            self.assertEqual(APIError(code).status, status)

    def test_log_errors_map_by_code(self):
        from streamproto.log import errors
        self.assertEqual(from_exception(errors.LogNotFound("x")).code, "log_not_found")
        self.assertEqual(from_exception(errors.LogExists("x")).status, 400)
        self.assertEqual(from_exception(errors.RecordTooLarge("big")).code, "record_too_large")
        self.assertEqual(from_exception(errors.LogFailed("io")).code, "log_not_available")
        self.assertEqual(from_exception(errors.PositionOutOfRange("p")).code, "invalid_params")
        self.assertEqual(from_exception(KeyError("x")).code, "unknown_error")
        self.assertEqual(from_exception(KeyError("x")).status, 500)

    def test_error_json(self):
        self.assertEqual(json.loads(APIError("not_found").to_json()),
                         {"code": "not_found", "message": "api: not found"})


class ParamsTests(unittest.SynchronousTestCase):
    def test_defaults(self):
        self.assertEqual(parse_read_params({}), ReadParams("origin", 0, -1, False))

    def test_values(self):
        p = parse_read_params({b"whence": [b"end"], b"position": [b"-2"], b"count": [b"7"],
                               b"follow": [b"true"]})
        self.assertEqual(p, ReadParams("end", -2, 7, True))
        self.assertEqual(p.resolve(3, 10), 8)
        self.assertEqual(ReadParams("start", 2).resolve(3, 10), 5)
        self.assertEqual(ReadParams("current", 2).resolve(3, 10), 5)
        self.assertEqual(ReadParams("origin", 4).resolve(3, 10), 4)
        self.assertTrue(parse_read_params({"follow": ["1"]}).follow)
        self.assertFalse(parse_read_params({"follow": ["false"]}).follow)

    def test_invalid(self):
        for args in ({b"whence": [b"middle"]}, {b"position": [b"x"]}, {b"count": [b"1.5"]},
                     {b"count": [b"-2"]}, {b"follow": [b"maybe"]}):
            e = self.assertRaises(APIError, parse_read_params, args)
            self.assertEqual(e.code, "invalid_params")
            self.assertTrue(e.message.startswith("api: params: "))


class FormatTests(unittest.SynchronousTestCase):
    def test_media_types(self):
        self.assertEqual(formats.format_of(None).kind, "record")
        self.assertEqual(formats.format_of("application/octet-stream").kind, "record")
        self.assertEqual(formats.format_of("text/plain").kind, "record")
        self.assertEqual(formats.format_of(BINARY).kind, "binary")
        f = formats.format_of(LINES + "; line-ending=crlf")
        self.assertEqual((f.kind, f.delimiter), ("lines", b"\r\n"))
        self.assertEqual(formats.format_of(LINES).delimiter, b"\n")
        self.assertRaises(formats.FormatError, formats.format_of, LINES + ";line-ending=nl")

    def test_binary_decoder_incremental(self):
        body = binary([b"a", b"", b"ccc" * 100])
        for step in (1, 3, 7, len(body)):
            d = formats.BinaryDecoder(1000)
            out = []
            for i in range(0, len(body), step):
                out += d.feed(body[i:i + step])
            out += d.close()
            self.assertEqual(out, [b"a", b"", b"ccc" * 100])

    def test_binary_decoder_errors(self):
        from streamproto.log.errors import RecordTooLarge
        self.assertRaises(formats.FormatError, formats.BinaryDecoder(10).feed,
                          struct.pack(">i", -1))
        self.assertRaises(RecordTooLarge, formats.BinaryDecoder(10).feed, struct.pack(">i", 11))
        d = formats.BinaryDecoder(10)
        d.feed(struct.pack(">i", 5) + b"ab")
        self.assertRaises(formats.FormatError, d.close)

    def test_lines_decoder_split_delimiter(self):
        d = formats.LinesDecoder(b"\r\n", 100)
        out = d.feed(b"a\r") + d.feed(b"\nb\r\nc")
        out += d.close()
        self.assertEqual(out, [b"a", b"b", b"c"])

    def test_lines_limit_with_split_delimiter(self):
        # found by hypothesis: a full-size line whose CRLF arrives split
        from streamproto.log.errors import RecordTooLarge
        d = formats.LinesDecoder(b"\r\n", 3)
        self.assertEqual(d.feed(b"abc\r"), [])
        self.assertEqual(d.feed(b"\n"), [b"abc"])
        d.feed(b"abcd")
        self.assertRaises(RecordTooLarge, d.close)

    def test_encoders(self):
        from streamproto.log import RecordBatch
        batch = RecordBatch.from_records(5, [b"x", b"yy", b""])
        self.assertEqual(formats.encode_binary(batch), binary([b"x", b"yy", b""]))
        self.assertEqual(formats.lines("cr").encoder()(batch), b"x\ryy\r\r")


class FormatFuzzTests(unittest.SynchronousTestCase):
    """Decoders are pure: arbitrary bytes give records or their own errors only."""

    @settings(max_examples=200, deadline=None)
    @given(st.binary(max_size=300), st.integers(1, 64), st.integers(0, 100))
    def test_binary_decoder_arbitrary_bytes(self, body, step, limit):
        from streamproto.log.errors import RecordTooLarge
        d = formats.BinaryDecoder(limit)
        try:
            for i in range(0, len(body), step):
                for r in d.feed(body[i:i + step]):
                    self.assertLessEqual(len(r), limit)
            d.close()
        except (formats.FormatError, RecordTooLarge):
            pass

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.binary(max_size=50), max_size=20), st.integers(1, 32))
    def test_binary_round_trip(self, records, step):
        from streamproto.log import RecordBatch
        body = formats.encode_binary(RecordBatch.from_records(0, records))
        self.assertEqual(body, formats.encode_records(formats.BINARY, records))
        d = formats.BinaryDecoder(50)
        out = []
        for i in range(0, len(body), step):
            out += d.feed(body[i:i + step])
        self.assertEqual(out + d.close(), records)

    @settings(max_examples=200, deadline=None)
    @given(st.binary(max_size=300), st.integers(1, 64), st.integers(0, 100))
    def test_binary_feed_batch_same_as_feed(self, body, step, limit):
        """The batch decoding (sizes + one buffer, what a streamed produce
        appends) yields the records and the errors of the per-record one,
        however the body is cut."""
        from streamproto.log.errors import RecordTooLarge

        def decode(method):
            d = formats.BinaryDecoder(limit)
            out = []
            try:
                for i in range(0, len(body), step):
                    got = getattr(d, method)(body[i:i + step])
                    out += got.records() if method == "feed_batch" else got
                d.close()
            except (formats.FormatError, RecordTooLarge) as e:
                return out, type(e)
            return out, None

        self.assertEqual(decode("feed_batch"), decode("feed"))

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.binary(max_size=30).filter(lambda r: b"\r" not in r and b"\n" not in r
                                                   and r), max_size=20),
           st.sampled_from(["lf", "cr", "crlf"]), st.integers(1, 16))
    def test_lines_round_trip(self, records, ending, step):
        from streamproto.log import RecordBatch
        fmt = formats.lines(ending)
        body = fmt.encoder()(RecordBatch.from_records(0, records))
        d = fmt.decoder(30)
        out = []
        for i in range(0, len(body), step):
            out += d.feed(body[i:i + step])
        self.assertEqual(out + d.close(), records)


class LogsRouteTests(HTTPTestBase):
    @defer.inlineCallbacks
    def test_list_empty(self):
        response, content = yield self.call("GET", "/logs")
        self.assertEqual(response.code, 200)
        self.assertEqual(json.loads(content), [])

    @defer.inlineCallbacks
    def test_create_get_list(self):
        info = yield self.make_log("events", log_max_count="100")
        self.assertEqual(list(info), ["name", "status", "record_count", "file_size",
                                      "start_position", "end_position"])
        self.assertEqual(info, {"name": "events", "status": "ok", "record_count": 0,
                                "file_size": 0, "start_position": 0, "end_position": 0})
        log = yield self.memory.get("events")
        # form fields override the server's defaults, which override LogConfig's
        self.assertEqual(log.config.log_max_count, 100)
        self.assertEqual(log.config.max_record_size, 4096)
        yield log.append([b"abc", b"de"])
        response, content = yield self.call("GET", "/logs/events")
        self.assertEqual(json.loads(content)["record_count"], 2)
        self.assertEqual(json.loads(content)["file_size"], 5)
        yield self.make_log("audit")
        response, content = yield self.call("GET", "/logs")
        self.assertEqual([i["name"] for i in json.loads(content)], ["audit", "events"])
        # the reference's formatting: indented, newline-terminated
        self.assertTrue(content.endswith(b"}\n]\n"))

    @defer.inlineCallbacks
    def test_create_errors(self):
        yield self.make_log("events")
        yield self.assertError("POST", "/logs", 400, "log_exist", data={"name": "events"})
        yield self.assertError("POST", "/logs", 400, "log_invalid_name", data={"name": "a.b"})
        yield self.assertError("POST", "/logs", 400, "invalid_params", data={"x": "1"})
        yield self.assertError("POST", "/logs", 400, "invalid_params",
                               data={"name": "n", "max_record_size": "big"})
        yield self.assertError("POST", "/logs", 400, "invalid_params",
                               data={"name": "n", "max_record_size": "0"})
        self.assertEqual(self.memory.names(), ["events"])

    @defer.inlineCallbacks
    def test_get_delete_truncate(self):
        yield self.make_log("events", records=[b"a", b"b", b"c"])
        yield self.assertError("GET", "/logs/nope", 404, "log_not_found")
        response, content = yield self.call("POST", "/logs/events/truncate")
        self.assertEqual((response.code, content), (200, b""))
        response, content = yield self.call("GET", "/logs/events")
        info = json.loads(content)
        # as the reference: empty, positions start again at 0, config kept
        self.assertEqual((info["start_position"], info["end_position"], info["record_count"]),
                         (0, 0, 0))
        yield self.call("POST", "/logs/events/records", body=b"d")
        response, content = yield self.call("GET", "/logs/events/records")
        self.assertEqual(content, b"d")
        yield self.assertError("POST", "/logs/nope/truncate", 404, "log_not_found")
        response, content = yield self.call("DELETE", "/logs/events")
        self.assertEqual((response.code, content), (200, b""))
        self.assertEqual(self.memory.names(), [])
        yield self.assertError("DELETE", "/logs/events", 404, "log_not_found")

    @defer.inlineCallbacks
    def test_unknown_routes_and_methods(self):
        yield self.make_log("events")
        yield self.assertError("GET", "/", 404, "not_found")
        yield self.assertError("GET", "/nope", 404, "not_found")
        yield self.assertError("GET", "/logs/", 404, "not_found")
        yield self.assertError("GET", "/logs/events/nope", 404, "not_found")
        yield self.assertError("GET", "/logs/events/records/x", 404, "not_found")
        yield self.assertError("PUT", "/logs", 405, "method_not_allowed")
        yield self.assertError("POST", "/logs/events", 405, "method_not_allowed")
        yield self.assertError("GET", "/logs/events/truncate", 405, "method_not_allowed")
        yield self.assertError("POST", "/logs/events/backup", 405, "method_not_allowed")
        yield self.assertError("DELETE", "/logs/events/records", 405, "method_not_allowed")
        # as in the reference, GET /logs/restore is a log named "restore"
        yield self.assertError("GET", "/logs/restore", 404, "log_not_found")

    @defer.inlineCallbacks
    def test_backup_needs_file_store(self):
        yield self.make_log("events")
        yield self.assertError("GET", "/logs/events/backup", 501, "not_supported")
        yield self.assertError("POST", "/logs/restore?name=x", 501, "not_supported",
                               body=b"x")
        yield self.assertError("GET", "/logs/nope/backup", 404, "log_not_found")
        yield self.assertError("POST", "/logs/restore", 400, "invalid_params", body=b"x")

    @defer.inlineCallbacks
    def test_metrics(self):
        from prometheus_client import REGISTRY

        def suite(name):
            return REGISTRY.get_sample_value(name, {"server": "styx-server"}) or 0.0
        before_in = suite("streamproto_records_in_total")
        before_out = suite("streamproto_records_out_total")
        yield self.make_log("events")
        yield self.call("POST", "/logs/events/records", body=binary([b"ab", b"cd", b"e"]),
                        headers={"Content-Type": BINARY})
        yield self.call("GET", "/logs/events/records?count=2", headers={"Accept": BINARY})
        yield self.call("GET", "/logs/nope")
        response, content = yield self.call("GET", "/metrics")
        self.assertEqual(response.code, 200)
        text = content.decode()
        self.assertIn('styx_records_produced_total{log="events"} 3.0', text)
        self.assertIn('styx_bytes_produced_total{log="events"} 5.0', text)
        self.assertIn('styx_records_consumed_total{log="events"} 2.0', text)
        self.assertIn('log_record_count{log="events"} 3.0', text)
        self.assertIn('log_file_size{log="events"} 5.0', text)
        self.assertIn('styx_http_errors_total{code="log_not_found"} 1.0', text)
        self.assertTrue(response.headers.getRawHeaders("content-type")[0].startswith(
            "text/plain"))
        # the suite-wide metrics are served too, and counted these records
        self.assertIn("streamproto_fsync_seconds", text)
        self.assertEqual(suite("streamproto_records_in_total") - before_in, 3)
        self.assertEqual(suite("streamproto_records_out_total") - before_out, 2)


class CORSTests(HTTPTestBase):
    @defer.inlineCallbacks
    def test_any_origin_by_default(self):
        yield self.make_log("events")
        response, content = yield self.call("GET", "/logs",
                                            headers={"Origin": "https://app.example"})
        self.assertEqual(response.headers.getRawHeaders("access-control-allow-origin"),
                         ["*"])
        self.assertIn("Origin", response.headers.getRawHeaders("vary"))
        response, content = yield self.call("GET", "/logs")
        self.assertFalse(response.headers.hasHeader("access-control-allow-origin"))
        # as the reference (rs/cors): Vary: Origin even without an Origin
        self.assertEqual(response.headers.getRawHeaders("vary"), ["Origin"])

    @defer.inlineCallbacks
    def test_no_vary_without_cors(self):
        self.site.resource.cors_origins = ()
        response, content = yield self.call("GET", "/logs",
                                            headers={"Origin": "https://app.example"})
        self.assertFalse(response.headers.hasHeader("vary"))
        self.assertFalse(response.headers.hasHeader("access-control-allow-origin"))

    @defer.inlineCallbacks
    def test_preflight(self):
        response, content = yield self.call(
            "OPTIONS", "/logs/events/records",
            headers={"Origin": "https://app.example", "Access-Control-Request-Method": "post",
                     "Access-Control-Request-Headers": "Content-Type, X-Styx-Timeout"})
        self.assertEqual(response.code, 204)
        h = response.headers
        self.assertEqual(h.getRawHeaders("access-control-allow-origin"), ["*"])
        self.assertEqual(h.getRawHeaders("access-control-allow-methods"), ["POST"])
        self.assertEqual(h.getRawHeaders("access-control-allow-headers"),
                         ["Content-Type, X-Styx-Timeout"])
        response, content = yield self.call(
            "OPTIONS", "/logs", headers={"Origin": "https://app.example",
                                         "Access-Control-Request-Method": "TRACE"})
        self.assertFalse(response.headers.hasHeader("access-control-allow-origin"))

    @defer.inlineCallbacks
    def test_listed_origins(self):
        self.site.resource.cors_origins = ("https://*.example.com", "http://localhost:3000")
        for origin, allowed in (("https://app.example.com", True),
                                ("http://localhost:3000", True),
                                ("https://example.org", False)):
            response, content = yield self.call("GET", "/logs", headers={"Origin": origin})
            self.assertEqual(response.headers.getRawHeaders("access-control-allow-origin"),
                             [origin] if allowed else None, origin)


class ProduceTests(HTTPTestBase):
    @defer.inlineCallbacks
    def records(self, name="events"):
        log = yield self.memory.get(name)
        batch = yield log.read(log.start_position, max_bytes=1 << 30)
        return batch.records()

    @defer.inlineCallbacks
    def test_single_record(self):
        yield self.make_log("events", records=[b"first"])
        response, content = yield self.call("POST", "/logs/events/records", body=b"hello")
        self.assertEqual(response.code, 200)
        self.assertEqual(json.loads(content), {"position": 2, "count": 1})
        response, content = yield self.call(
            "POST", "/logs/events/records", body=b"\x00\xff",
            headers={"Content-Type": "application/octet-stream"})
        self.assertEqual(json.loads(content), {"position": 3, "count": 1})
        self.assertEqual((yield self.records()), [b"first", b"hello", b"\x00\xff"])

    @defer.inlineCallbacks
    def test_empty_single_record(self):
        yield self.make_log("events")
        response, content = yield self.call("POST", "/logs/events/records", body=b"")
        # the reference answers this without touching the log
        self.assertEqual(json.loads(content), {"position": 0, "count": 0})
        self.assertEqual((yield self.records()), [])

    @defer.inlineCallbacks
    def test_missing_content_length(self):
        yield self.make_log("events")
        response = yield self.raw(
            b"POST /logs/events/records HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        self.assertTrue(response.startswith(b"HTTP/1.1 400 "), response)
        self.assertIn(b'"code": "missing_content_length"', response)
        self.assertEqual((yield self.records()), [])

    @defer.inlineCallbacks
    def test_chunked_batches_need_no_length(self):
        # the Go client streams binary batches with chunked encoding
        yield self.make_log("events")
        body = binary([b"a", b"bb"])
        response = yield self.raw(
            b"POST /logs/events/records HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: " + BINARY.encode() + b"\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(body) + body +
            b"\r\n0\r\n\r\n")
        self.assertTrue(response.startswith(b"HTTP/1.1 200 "), response)
        self.assertEqual((yield self.records()), [b"a", b"bb"])

    @defer.inlineCallbacks
    def test_unknown_log(self):
        yield self.assertError("POST", "/logs/nope/records", 404, "log_not_found", body=b"x")
        yield self.assertError("POST", "/logs/nope/records", 404, "log_not_found",
                               body=binary([b"x"]), headers={"Content-Type": BINARY})

    @defer.inlineCallbacks
    def test_lines_every_ending(self):
        yield self.make_log("events")
        expected = []
        for ending, delimiter in (("lf", b"\n"), ("cr", b"\r"), ("crlf", b"\r\n")):
            lines = [f"{ending}-{i}".encode() for i in range(3)]
            response, content = yield self.call(
                "POST", "/logs/events/records", body=delimiter.join(lines) + delimiter,
                headers={"Content-Type": f"{LINES};line-ending={ending}"})
            expected += lines
            self.assertEqual(json.loads(content), {"position": len(expected), "count": 3})
        # no line-ending parameter means lf; a last unterminated line counts
        response, content = yield self.call("POST", "/logs/events/records", body=b"x\ny",
                                            headers={"Content-Type": LINES})
        self.assertEqual(json.loads(content)["count"], 2)
        self.assertEqual((yield self.records()), expected + [b"x", b"y"])
        yield self.assertError("POST", "/logs/events/records", 400, "unknown_error",
                               body=b"a\n", headers={"Content-Type": LINES + ";line-ending=x"})

    @defer.inlineCallbacks
    def test_binary(self):
        yield self.make_log("events")
        records = [b"", b"a", b"\n\r\x00" * 100, os.urandom(4000)]
        response, content = yield self.call("POST", "/logs/events/records",
                                            body=binary(records),
                                            headers={"Content-Type": BINARY})
        self.assertEqual(json.loads(content), {"position": 4, "count": 4})
        self.assertEqual((yield self.records()), records)

    @defer.inlineCallbacks
    def test_malformed_binary(self):
        yield self.make_log("events")
        yield self.assertError("POST", "/logs/events/records", 400, "invalid_params",
                               body=struct.pack(">i", -5) + b"x",
                               headers={"Content-Type": BINARY})
        yield self.assertError("POST", "/logs/events/records", 400, "invalid_params",
                               body=struct.pack(">i", 10) + b"short",
                               headers={"Content-Type": BINARY})
        self.assertEqual((yield self.records()), [])

    @defer.inlineCallbacks
    def test_record_too_large(self):
        yield self.make_log("events", max_record_size="10")
        error = yield self.assertError("POST", "/logs/events/records", 400,
                                       "record_too_large", body=b"x" * 11)
        self.assertIn("max_record_size 10", error["message"])
        yield self.assertError("POST", "/logs/events/records", 400, "record_too_large",
                               body=binary([b"x" * 11]), headers={"Content-Type": BINARY})
        yield self.assertError("POST", "/logs/events/records", 400, "record_too_large",
                               body=b"y" * 20 + b"\n", headers={"Content-Type": LINES})
        self.assertEqual((yield self.records()), [])
        response, content = yield self.call("POST", "/logs/events/records", body=b"x" * 10)
        self.assertEqual(response.code, 200)

    @defer.inlineCallbacks
    def test_many_records_in_chunks(self):
        # more records than one append call takes, over several body chunks
        yield self.make_log("events")
        records = [b"%d" % i for i in range(40000)]
        response, content = yield self.call("POST", "/logs/events/records",
                                            body=binary(records),
                                            headers={"Content-Type": BINARY})
        self.assertEqual(json.loads(content), {"position": 40000, "count": 40000})
        self.assertEqual((yield self.records()), records)


class BodyLimitTests(HTTPTestBase):
    max_body_size = 1000

    @defer.inlineCallbacks
    def test_declared_length_refused(self):
        yield self.make_log("events")
        error = yield self.assertError("POST", "/logs/events/records", 413,
                                       "request_too_large", body=b"x" * 1001)
        self.assertIn("1000", error["message"])
        response, content = yield self.call("POST", "/logs/events/records", body=b"x" * 1000)
        self.assertEqual(response.code, 200)
        log = yield self.memory.get("events")
        self.assertEqual(log.end_position, 1)

    @defer.inlineCallbacks
    def test_restores_have_their_own_bound(self):
        self.site.max_restore_size = 1500
        # 1200 bytes pass the restore bound (then fail as no backup) ...
        yield self.assertError("POST", "/logs/restore?name=x", 501, "not_supported",
                               body=b"x" * 1200)
        # ... but not the general one, nor 1600 the restore one
        yield self.assertError("POST", "/logs/x/records", 413, "request_too_large",
                               body=b"x" * 1200)
        yield self.assertError("POST", "/logs/restore?name=x", 413, "request_too_large",
                               body=b"x" * 1600)

    @defer.inlineCallbacks
    def test_chunked_body_refused(self):
        yield self.make_log("events")
        chunk = b"y" * 600
        response = yield self.raw(
            b"POST /logs/events/records HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/octet-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" +
            (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 3 + b"0\r\n\r\n")
        self.assertTrue(response.startswith(b"HTTP/1.1 413 "), response)
        self.assertIn(b'"request_too_large"', response)
        log = yield self.memory.get("events")
        self.assertEqual(log.end_position, 0)

    @defer.inlineCallbacks
    def test_refusal_carries_cors_headers(self):
        # a browser can only read the 413 if it is marked like any answer
        yield self.make_log("events")
        response = yield self.raw(
            b"POST /logs/events/records HTTP/1.1\r\nHost: x\r\n"
            b"Origin: https://app.example\r\n"
            b"Content-Type: application/octet-stream\r\n"
            b"Content-Length: 5000\r\n\r\n" + b"x" * 5000)
        head = response.split(b"\r\n\r\n", 1)[0].lower()
        self.assertTrue(head.startswith(b"http/1.1 413 "), response)
        self.assertIn(b"\r\naccess-control-allow-origin: *\r\n", head)
        self.assertIn(b"\r\nvary: origin", head)

    @defer.inlineCallbacks
    def test_batch_bodies_are_streamed_not_bounded(self):
        # line-delimited and binary bodies go to the log as they arrive
        yield self.make_log("events")
        lines = [b"%04d" % i for i in range(1000)]
        response, content = yield self.call("POST", "/logs/events/records",
                                            body=b"\n".join(lines) + b"\n",
                                            headers={"Content-Type": LINES})
        self.assertEqual(json.loads(content), {"position": 1000, "count": 1000})
        chunk = binary([b"z" * 200] * 5)
        response = yield self.raw(
            b"POST /logs/events/records HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: " + BINARY.encode() + b"\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" +
            (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 4 + b"0\r\n\r\n")
        self.assertTrue(response.startswith(b"HTTP/1.1 200 "), response)
        self.assertIn(b'"count": 20', response)
        log = yield self.memory.get("events")
        self.assertEqual(log.end_position, 1020)


class ConsumeTests(HTTPTestBase):
    @defer.inlineCallbacks
    def setUp(self):
        super().setUp()
        self.records = [b"r%d" % i for i in range(10)]
        yield self.make_log("events", records=self.records)

    @defer.inlineCallbacks
    def get(self, query="", accept=BINARY, headers=None):
        h = {"Accept": accept} if accept else {}
        h.update(headers or {})
        response, content = yield self.call("GET", "/logs/events/records" + query, headers=h)
        self.assertEqual(response.code, 200, content)
        return response, content

    @defer.inlineCallbacks
    def test_binary(self):
        response, content = yield self.get()
        self.assertEqual(response.headers.getRawHeaders("content-type"), [BINARY])
        self.assertEqual(unbinary(content), self.records)

    @defer.inlineCallbacks
    def test_lines_every_ending(self):
        for ending, delimiter in (("lf", b"\n"), ("cr", b"\r"), ("crlf", b"\r\n")):
            response, content = yield self.get("?count=3", f"{LINES};line-ending={ending}")
            self.assertEqual(response.headers.getRawHeaders("content-type"),
                             [f"{LINES}; line-ending={ending}"])
            self.assertEqual(content, delimiter.join(self.records[:3]) + delimiter)
        response, content = yield self.get("?position=8", LINES)
        self.assertEqual(content, b"r8\nr9\n")

    @defer.inlineCallbacks
    def test_whence_position_count(self):
        cases = {
            "?position=4&count=2": self.records[4:6],
            "?whence=origin&position=9": self.records[9:],
            "?whence=end&position=-3": self.records[7:],
            "?whence=end": [],
            "?whence=start&position=1&count=1": self.records[1:2],
            "?count=0": [],
            "?position=10": [],
        }
        for query, expected in cases.items():
            response, content = yield self.get(query)
            self.assertEqual(unbinary(content), expected, query)
        log = yield self.memory.get("events")
        yield log.truncate(5)
        response, content = yield self.get("?whence=start&position=1")
        self.assertEqual(unbinary(content), self.records[6:])

    @defer.inlineCallbacks
    def test_invalid_params(self):
        for query in ("?whence=middle", "?position=x", "?count=-9", "?follow=maybe",
                      "?position=11", "?whence=end&position=-11"):
            yield self.assertError("GET", "/logs/events/records" + query, 400,
                                   "invalid_params", headers={"Accept": BINARY})
        log = yield self.memory.get("events")
        yield log.truncate(5)
        yield self.assertError("GET", "/logs/events/records?position=4", 400,
                               "invalid_params")
        yield self.assertError("GET", "/logs/nope/records", 404, "log_not_found",
                               headers={"Accept": BINARY})
        yield self.assertError("GET", "/logs/events/records?follow=true", 400,
                               "unknown_error",
                               headers={"Accept": BINARY, "X-Styx-Timeout": "soon"})

    @defer.inlineCallbacks
    def test_single_record(self):
        response, content = yield self.get("?position=3", accept=None)
        self.assertEqual(content, b"r3")
        self.assertEqual(response.headers.getRawHeaders("content-type"),
                         ["application/octet-stream"])
        response, content = yield self.get("?whence=end&position=-1",
                                           accept="application/octet-stream")
        self.assertEqual(content, b"r9")
        # at the end: an empty 200 without a content type, like the reference
        response, content = yield self.get("?whence=end", accept=None)
        self.assertEqual(content, b"")
        self.assertFalse(response.headers.hasHeader("content-type"))
        yield self.assertError("GET", "/logs/events/records?position=12", 400,
                               "invalid_params")

    @defer.inlineCallbacks
    def test_end_without_follow_returns_at_once(self):
        response, content = yield self.get("?whence=end&count=5")
        self.assertEqual(content, b"")
        self.assertEqual(self.store.waits, [])

    @defer.inlineCallbacks
    def test_follow_returns_when_it_would_block(self):
        # records were sent: the response ends at the end of the log
        response, content = yield self.get("?position=8&follow=true",
                                           headers={"X-Styx-Timeout": "100"})
        self.assertEqual(unbinary(content), self.records[8:])
        self.assertEqual(self.store.waits, [])

    @defer.inlineCallbacks
    def test_long_poll_woken_by_append(self):
        waiting = self.store.waiting
        d = self.get("?whence=end&follow=true", headers={"X-Styx-Timeout": "100"})
        wait = yield waiting
        self.assertEqual(self.store.waits[0][1], 100)
        self.assertFalse(d.called)
        gauge = 'styx_active_streams{kind="http_consume"}'
        self.assertIn(gauge + " 1.0", self.site.resource.metrics.render([]).decode())
        log = yield self.memory.get("events")
        yield log.append([b"new1", b"new2"])
        response, content = yield d
        self.assertEqual(unbinary(content), [b"new1", b"new2"])
        self.assertTrue(wait.called)
        self.assertIn(gauge + " 0.0", self.site.resource.metrics.render([]).decode())

    @defer.inlineCallbacks
    def test_long_poll_lines(self):
        waiting = self.store.waiting
        d = self.get("?whence=end&follow=true", accept=LINES + ";line-ending=crlf")
        yield waiting
        log = yield self.memory.get("events")
        yield log.append([b"x"])
        response, content = yield d
        self.assertEqual(content, b"x\r\n")

    @defer.inlineCallbacks
    def test_long_poll_times_out(self):
        waiting = self.store.waiting
        d = self.get("?whence=end&follow=true", headers={"X-Styx-Timeout": "5"})
        yield waiting
        self.clock.advance(4)
        yield task.deferLater(reactor, 0.05, lambda: None)
        self.assertFalse(d.called)
        self.clock.advance(1)
        response, content = yield d
        self.assertEqual(content, b"")

    @defer.inlineCallbacks
    def test_follow_without_timeout_waits(self):
        waiting = self.store.waiting
        d = self.get("?whence=end&follow=true")
        yield waiting
        self.assertIsNone(self.store.waits[0][1])
        log = yield self.memory.get("events")
        yield log.append([b"late"])
        response, content = yield d
        self.assertEqual(unbinary(content), [b"late"])

    @defer.inlineCallbacks
    def test_timeout_ignored_without_follow(self):
        response, content = yield self.get("?whence=end", headers={"X-Styx-Timeout": "5"})
        self.assertEqual(content, b"")
        self.assertEqual(self.store.waits, [])

    @defer.inlineCallbacks
    def test_single_record_follow(self):
        waiting = self.store.waiting
        d = self.get("?whence=end&follow=true", accept=None,
                     headers={"X-Styx-Timeout": "3"})
        yield waiting
        log = yield self.memory.get("events")
        yield log.append([b"one", b"two"])
        response, content = yield d
        self.assertEqual(content, b"one")

    @defer.inlineCallbacks
    def test_log_deleted_during_long_poll(self):
        waiting = self.store.waiting
        d = self.call("GET", "/logs/events/records?whence=end&follow=true",
                      headers={"Accept": BINARY})
        yield waiting
        response, content = yield self.call("DELETE", "/logs/events")
        self.assertEqual(response.code, 200)
        response, content = yield d
        self.assertEqual(response.code, 400)
        self.assertEqual(json.loads(content)["code"], "log_not_available")
        # the server carries on
        yield self.make_log("events", records=[b"again"])
        response, content = yield self.get()
        self.assertEqual(unbinary(content), [b"again"])

    @defer.inlineCallbacks
    def test_disconnect_cancels_wait(self):
        waiting = self.store.waiting
        proto = yield self.open_raw(
            b"GET /logs/events/records?whence=end&follow=true HTTP/1.1\r\n"
            b"Host: x\r\nAccept: " + BINARY.encode() + b"\r\n\r\n")
        wait = yield waiting
        proto.transport.loseConnection()
        yield proto.done
        for _ in range(100):
            if wait.called:
                break
            yield task.deferLater(reactor, 0.01, lambda: None)
        self.assertEqual(self.store.cancelled, [defer.CancelledError])


class SlowConsumer(protocol.Protocol):
    """Reads nothing until told to, then counts bytes until the response ends."""

    def __init__(self, request):
        self.request = request
        self.received = 0
        self.body = bytearray()
        self.done = defer.Deferred()

    def connectionMade(self):
        self.transport.pauseProducing()
        self.transport.write(self.request)

    def dataReceived(self, data):
        self.received += len(data)
        self.body += data
        if self.body.endswith(b"\r\n0\r\n\r\n"):
            self.transport.loseConnection()

    def connectionLost(self, reason):
        self.done.callback(None)


class BackpressureTests(HTTPTestBase):
    @defer.inlineCallbacks
    def test_slow_consumer_pauses_reading(self):
        record = b"z" * 1000
        total = 48 * 1024 * 1024
        count = total // len(record)
        yield self.make_log("events", max_record_size="2000")
        log = yield self.memory.get("events")
        yield log.append([record] * count)
        consumer = SlowConsumer(b"GET /logs/events/records HTTP/1.1\r\nHost: x\r\n"
                                b"Accept: " + BINARY.encode() + b"\r\n\r\n")
        yield protocol.ClientCreator(reactor, lambda: consumer).connectTCP(
            "127.0.0.1", self.port.getHost().port)
        # wait until the server has started, then until it stops reading
        for _ in range(500):
            if self.store.read_bytes:
                break
            yield task.deferLater(reactor, 0.01, lambda: None)
        previous = -1
        for _ in range(100):
            if self.store.read_bytes == previous:
                break
            previous = self.store.read_bytes
            yield task.deferLater(reactor, 0.2, lambda: None)
        # the server stopped reading the log once the socket buffers filled
        read_while_paused = self.store.read_bytes
        self.assertGreater(read_while_paused, 0)
        self.assertLess(read_while_paused, total // 3)
        consumer.transport.resumeProducing()
        yield consumer.done
        self.assertEqual(self.store.read_bytes, total // len(record) * len(record))
        self.assertGreater(consumer.received, count * (len(record) + 4))


class HoldingLog:
    """A log whose appends are acknowledged only when the test says so."""

    def __init__(self, log):
        self._log = log
        self.held = []
        self.appended_bytes = 0
        self.holding = True

    def __getattr__(self, name):
        return getattr(self._log, name)

    def append(self, records, attributes=None):
        self.appended_bytes += sum(map(len, records))
        d = self._log.append(records, attributes)
        if not self.holding:
            return d
        held = defer.Deferred()
        d.addBoth(lambda result: self.held.append((held, result)))
        return held

    def release(self):
        self.holding = False
        held, self.held = self.held, []
        for d, result in held:
            d.callback(result)


class ProduceBackpressureTests(HTTPTestBase):
    @defer.inlineCallbacks
    def test_slow_fsync_stops_reading_the_body(self):
        from streamproto.styx.produce import MAX_UNSYNCED_BYTES
        yield self.make_log("events")
        holding = HoldingLog((yield self.memory.get("events")))
        self.patch(self.memory, "get", lambda name: defer.succeed(holding))
        record = b"p" * 1000
        count = 40 * 1024
        body = binary([record] * count)
        proto = yield self.open_raw(records_post(body))
        previous = -1
        for _ in range(100):
            yield task.deferLater(reactor, 0.1, lambda: None)
            if holding.appended_bytes and holding.appended_bytes == previous:
                break
            previous = holding.appended_bytes
        # appends stopped at the bound while nothing was durable
        self.assertGreater(holding.appended_bytes, 0)
        self.assertLessEqual(holding.appended_bytes, MAX_UNSYNCED_BYTES + 2 * 1024 * 1024)
        self.assertLess(holding.appended_bytes, len(record) * count)
        self.assertFalse(proto.done.called)
        holding.release()
        response = yield proto.done
        self.assertTrue(response.startswith(b"HTTP/1.1 200 "), response[:200])
        self.assertIn(b'"count": %d' % count, response)
        self.assertEqual(holding.appended_bytes, len(record) * count)

    @defer.inlineCallbacks
    def test_disconnect_mid_body_keeps_complete_records_only(self):
        yield self.make_log("events")
        body = binary([b"a" * 10] * 3)[:-4]  # the third record cut short
        proto = yield self.open_raw(records_post(body, length=1000, close=False))
        yield task.deferLater(reactor, 0.1, lambda: None)
        proto.transport.loseConnection()
        yield proto.done
        log = yield self.memory.get("events")
        for _ in range(50):
            if log.end_position:
                break
            yield task.deferLater(reactor, 0.02, lambda: None)
        batch = yield log.read(0)
        self.assertEqual(batch.records(), [b"a" * 10] * 2)


class LateOpeningStoreTests(HTTPTestBase):
    """
    A store whose C{get()} answers later (JetStream asks the cluster): a
    batch produce body complete before the log is open is answered only
    once its records are appended and durable, with their count and end
    position, or with an error, never with C{count: 0}.
    """

    def late_get(self):
        opening = []

        def get(name):
            d = defer.Deferred()
            opening.append((name, d))
            return d
        self.patch(self.store, "get", get)
        return opening

    @defer.inlineCallbacks
    def post_lines(self, lines):
        body = b"".join(b"%s\n" % line for line in lines)
        proto = yield self.open_raw(records_post(body, LINES))
        return proto

    @defer.inlineCallbacks
    def test_answer_waits_for_the_log_and_the_append(self):
        yield self.make_log("events", records=[b"before"])
        opening = self.late_get()
        lines = [b"line %d" % i for i in range(10)]
        proto = yield self.post_lines(lines)
        for _ in range(20):
            yield task.deferLater(reactor, 0.01, lambda: None)
        self.assertEqual(len(opening), 1)
        self.assertFalse(proto.done.called, "answered before the log was open")
        log = yield self.memory.get("events")
        holding = HoldingLog(log)
        opening[0][1].callback(holding)
        for _ in range(20):
            yield task.deferLater(reactor, 0.01, lambda: None)
        self.assertEqual(holding.appended_bytes, sum(map(len, lines)))
        self.assertFalse(proto.done.called, "answered before the append was durable")
        holding.release()
        response = yield proto.done
        self.assertTrue(response.startswith(b"HTTP/1.1 200 "), response)
        self.assertEqual(json.loads(response.split(b"\r\n\r\n", 1)[1]),
                         {"position": 11, "count": 10})
        batch = yield log.read(0, max_bytes=1 << 20)
        self.assertEqual(batch.records(), [b"before"] + lines)

    @defer.inlineCallbacks
    def test_store_unreachable_is_an_error(self):
        from streamproto.log.errors import StoreUnavailable
        yield self.make_log("events")
        opening = self.late_get()
        proto = yield self.post_lines([b"x"])
        yield task.deferLater(reactor, 0.05, lambda: None)
        self.assertFalse(proto.done.called)
        opening[0][1].errback(StoreUnavailable("JetStream: no answer"))
        response = yield proto.done
        self.assertFalse(response.startswith(b"HTTP/1.1 2"), response)
        self.assertIn(b"not_available", response)

    @defer.inlineCallbacks
    def test_failed_append_is_an_error(self):
        from streamproto.log.errors import StoreUnavailable
        yield self.make_log("events")
        opening = self.late_get()
        proto = yield self.post_lines([b"x", b"y"])
        yield task.deferLater(reactor, 0.05, lambda: None)
        log = yield self.memory.get("events")
        self.patch(log, "append", lambda records, attributes=None: defer.fail(
            StoreUnavailable("JetStream did not acknowledge within 20s")))
        opening[0][1].callback(log)
        response = yield proto.done
        self.assertFalse(response.startswith(b"HTTP/1.1 2"), response)

    @defer.inlineCallbacks
    def test_lost_connection_before_the_log_opened(self):
        """Only the complete records of a cut body are appended, as when the log is open."""
        yield self.make_log("events")
        opening = self.late_get()
        body = binary([b"a" * 10] * 3)[:-4]
        proto = yield self.open_raw(records_post(body, length=1000, close=False))
        yield task.deferLater(reactor, 0.05, lambda: None)
        proto.transport.loseConnection()
        yield proto.done
        yield task.deferLater(reactor, 0.05, lambda: None)
        log = yield self.memory.get("events")
        opening[0][1].callback(log)
        yield task.deferLater(reactor, 0.05, lambda: None)
        batch = yield log.read(0)
        self.assertEqual(batch.records(), [b"a" * 10] * 2)


class UpgradeHookTests(HTTPTestBase):
    @defer.inlineCallbacks
    def test_styx_upgrade_handed_over(self):
        yield self.make_log("events")
        response, content = yield self.call(
            "GET", "/logs/events/records?whence=end&follow=true",
            headers={"Upgrade": "styx/0", "Connection": "upgrade"})
        self.assertEqual((response.code, content), (418, b"upgraded"))
        method, name, params, kwargs = self.upgrades[0]
        self.assertEqual((method, name), (b"GET", "events"))
        self.assertEqual(params, ReadParams("end", 0, -1, True))
        self.assertEqual(kwargs["timeout"], 30)
        self.assertEqual(kwargs["protocol"], b"styx/0")
        response, content = yield self.call(
            "POST", "/logs/events/records",
            headers={"Upgrade": "websocket", "Connection": "Upgrade"})
        self.assertEqual(self.upgrades[1][0], b"POST")
        self.assertEqual(self.upgrades[1][3]["protocol"], b"websocket")
        # the reference's way for browsers to produce over WebSocket
        yield self.call("GET", "/logs/events/records",
                        headers={"Upgrade": "websocket", "Connection": "Upgrade",
                                 "X-HTTP-Method-Override": "POST"})
        self.assertEqual(self.upgrades[2][0], b"POST")

    @defer.inlineCallbacks
    def test_upgrade_errors_before_handover(self):
        yield self.make_log("events")
        yield self.assertError("GET", "/logs/nope/records", 404, "log_not_found",
                               headers={"Upgrade": "styx/0", "Connection": "upgrade"})
        yield self.assertError("GET", "/logs/events/records?whence=x", 400, "invalid_params",
                               headers={"Upgrade": "styx/0", "Connection": "upgrade"})
        self.assertEqual(self.upgrades, [])

    def test_timeout_bounds(self):
        self.assertRaises(ValueError, StyxResource, self.memory, timeout=1)


class MountedTests(unittest.TestCase):
    """The resource under another twisted.web site (bodies buffered by twisted)."""

    timeout = 30

    @defer.inlineCallbacks
    def test_mounted_under_a_prefix(self):
        from twisted.web.resource import Resource
        from twisted.web.server import Site
        store = MemoryLogStore(reactor)
        root = Resource()
        root.putChild(b"styx", StyxResource(store))
        port = reactor.listenTCP(0, Site(root), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(pool.closeCachedConnections)
        base = f"http://127.0.0.1:{port.getHost().port}/styx"
        response = yield treq.post(base + "/logs", data={"name": "events"}, pool=pool)
        self.assertEqual(response.code, 200, (yield response.content()))
        response = yield treq.post(base + "/logs/events/records",
                                   binary([b"a", b"b"] * 20000),
                                   headers={"Content-Type": BINARY}, pool=pool)
        self.assertEqual(json.loads((yield response.content())),
                         {"position": 40000, "count": 40000})
        response = yield treq.get(base + "/logs/events/records?position=39999",
                                  headers={"Accept": BINARY}, pool=pool)
        self.assertEqual(unbinary((yield response.content())), [b"b"])
        response = yield treq.post(base + "/logs/events/records", binary([b"x"])[:-1],
                                   headers={"Content-Type": BINARY}, pool=pool)
        self.assertEqual(response.code, 400)
        self.assertEqual(json.loads((yield response.content()))["code"], "invalid_params")


class TLSTests(unittest.TestCase):
    timeout = 30

    @defer.inlineCallbacks
    def test_api_over_mutual_tls(self):
        from streamproto.styx.api_client import StyxAPIError, StyxClient
        store = MemoryLogStore(reactor)
        port = yield serverFromString(reactor, certs().server_endpoint()).listen(
            make_site(store))
        self.addCleanup(port.stopListening)
        url = f"https://localhost:{port.getHost().port}"
        pool = HTTPConnectionPool(reactor, persistent=False)
        client = StyxClient(url, reactor, pool=pool, tls_options=certs().client_options())
        yield client.create_log("secure")
        yield client.write_records("secure", [b"a", b"b"])
        records = yield client.read_records("secure")
        self.assertEqual(records, [b"a", b"b"])
        anonymous = StyxClient(url, reactor, pool=pool,
                               tls_options=certs().client_options(with_cert=False))
        failure = yield self.assertFailure(anonymous.list_logs(), Exception)
        self.assertNotIsInstance(failure, StyxAPIError)
        yield pool.closeCachedConnections()


class FileStoreTests(unittest.TestCase):
    """End to end on the file-backed store: durability across reopen, backup/restore."""

    timeout = 30

    @defer.inlineCallbacks
    def setUp(self):
        self.path = tempfile.mkdtemp(prefix="styx-http-")
        self.addCleanup(__import__("shutil").rmtree, self.path, True)
        yield self.serve()

    @defer.inlineCallbacks
    def serve(self):
        self.store = open_store(self.path, reactor=reactor, retention_interval=0)
        self.port = reactor.listenTCP(0, make_site(self.store), interface="127.0.0.1")
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.base = f"http://127.0.0.1:{self.port.getHost().port}"
        yield None

    @defer.inlineCallbacks
    def stop(self):
        yield self.port.stopListening()
        yield self.pool.closeCachedConnections()
        yield self.store.close()

    def tearDown(self):
        return self.stop()

    @defer.inlineCallbacks
    def test_produce_reopen_consume_backup_restore(self):
        from streamproto.styx.api_client import StyxAPIError, StyxClient
        client = StyxClient(self.base, reactor, pool=self.pool)
        yield client.create_log("events")
        records = [b"rec-%d" % i for i in range(1000)]
        result = yield client.write_records("events", records)
        self.assertEqual(result, {"position": 1000, "count": 1000})
        yield client.write_records("events", [b"l1", b"l2"], formats.lines("crlf"))
        # durable: a new store on the same directory sees everything
        yield self.stop()
        yield self.serve()
        client = StyxClient(self.base, reactor, pool=self.pool)
        got = yield client.read_records("events", whence="start")
        self.assertEqual(got, records + [b"l1", b"l2"])
        archive = yield client.backup_log("events")
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            self.assertTrue(tar.getnames())
            self.assertTrue(all("/" not in n for n in tar.getnames()))
        e = yield self.assertFailure(client.restore_log("events", archive), StyxAPIError)
        self.assertEqual(e.code, "log_exist")
        yield client.restore_log("copy", archive)
        self.assertEqual(sorted(i["name"] for i in (yield client.list_logs())),
                         ["copy", "events"])
        got = yield client.read_records("copy")
        self.assertEqual(got, records + [b"l1", b"l2"])
        yield client.write_record("copy", b"more")
        self.assertEqual((yield client.get_log("copy"))["end_position"], 1003)
        self.assertEqual((yield client.get_log("events"))["end_position"], 1002)

    @defer.inlineCallbacks
    def test_restore_rejects_bad_archives(self):
        from streamproto.styx.api_client import StyxAPIError, StyxClient
        client = StyxClient(self.base, reactor, pool=self.pool)
        e = yield self.assertFailure(client.restore_log("x", b"not gzip"), StyxAPIError)
        self.assertEqual(e.code, "invalid_params")
        evil = io.BytesIO()
        with tarfile.open(fileobj=evil, mode="w:gz") as tar:
            info = tarfile.TarInfo("../escape")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
        e = yield self.assertFailure(client.restore_log("x", evil.getvalue()), StyxAPIError)
        self.assertEqual(e.code, "invalid_params")
        e = yield self.assertFailure(client.restore_log("a.b", evil.getvalue()), StyxAPIError)
        self.assertEqual(e.code, "log_invalid_name")
        self.assertEqual((yield client.list_logs()), [])
        self.assertFalse(os.path.exists(os.path.join(self.path, "..", "escape")))
        self.assertEqual([n for n in os.listdir(self.path) if n.startswith(".restore")], [])

    @defer.inlineCallbacks
    def test_restore_refuses_go_reference_backup(self):
        """
        A backup made by the Go reference (styx 0.1.4: a C{config} file and
        C{segment-...-records}/C{-index} files, another storage format) is
        refused with 400 invalid_params and leaves nothing behind: the name
        stays free for restore and create.  (It used to be unpacked into
        place, answer 404 log_not_found, and block the name.)
        """
        from streamproto.styx.api_client import StyxAPIError, StyxClient
        client = StyxClient(self.base, reactor, pool=self.pool)
        segment = "segment-00000000000000000000-00000000000000000000-00000000001795324029"
        go_backup = io.BytesIO()
        with tarfile.open(fileobj=go_backup, mode="w:gz") as tar:
            for member, data in (("config", b"\x00" * 68),
                                 (segment + "-records", b"\x00\x00\x00\x02hi" + b"\x00" * 8),
                                 (segment + "-index", b"\x00" * 16)):
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        e = yield self.assertFailure(client.restore_log("gobackup", go_backup.getvalue()),
                                     StyxAPIError)
        self.assertEqual((e.status, e.code), (400, "invalid_params"))
        self.assertIn("not a backup of this server's log store", e.message)
        self.assertEqual(os.listdir(self.path), [])
        # a config.json that is not a log configuration is refused the same way
        bad_config = io.BytesIO()
        with tarfile.open(fileobj=bad_config, mode="w:gz") as tar:
            info = tarfile.TarInfo("config.json")
            info.size = 9
            tar.addfile(info, io.BytesIO(b"not json!"))
        e = yield self.assertFailure(client.restore_log("gobackup", bad_config.getvalue()),
                                     StyxAPIError)
        self.assertEqual((e.status, e.code), (400, "invalid_params"))
        self.assertEqual(os.listdir(self.path), [])
        # the name is still free
        yield client.create_log("gobackup")
        self.assertEqual((yield client.get_log("gobackup"))["end_position"], 0)


class ProduceClientGoneTests(HTTPTestBase):
    """
    A producer that gives up while the store is slow to hand the log over
    (a paused JetStream node): the server must drop the request quietly,
    not fail on its closed body.  Found by test/faults (pause of a
    nats-server node under the styx workload).
    """

    @defer.inlineCallbacks
    def test_client_gone_while_store_looks_the_log_up(self):
        yield self.make_log("events")
        held = defer.Deferred()
        asked = defer.Deferred()
        real_get = self.store.get

        def slow_get(name):
            asked.callback(None)
            return held.addCallback(lambda _: real_get(name))
        self.store.get = slow_get
        proto = yield self.open_raw(records_post(b"hello", None, close=False))
        yield asked
        proto.transport.abortConnection()
        yield proto.done
        yield task.deferLater(reactor, 0.05, lambda: None)   # the server sees the loss
        self.store.get = real_get
        held.callback(None)
        yield task.deferLater(reactor, 0.05, lambda: None)
        log = yield self.memory.get("events")
        # nothing stored, and nothing logged as an unexpected error (trial
        # fails a test whose code logged a failure)
        self.assertEqual(log.end_position, 0)
