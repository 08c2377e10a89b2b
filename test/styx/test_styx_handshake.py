"""L{streamproto.styx.handshake}: the styx/0 upgrade, shared by the Twisted client and the Spark sink."""

from hypothesis import given
from hypothesis import strategies as st
from twisted.trial import unittest

from streamproto.styx.handshake import (
    HandshakeError, ResponseHead, parse_response_head, remote_timeout, request_head, upgraded,
)

UPGRADE = (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: styx/0\r\nConnection: Upgrade\r\n"
           b"X-Styx-Timeout: 12\r\n\r\n")


class RequestHeadTests(unittest.SynchronousTestCase):

    def test_produce(self):
        head = request_head("POST", "h:7123", "a log/x", timeout=9, token="t0k\nen",
                            base_path="/base/")
        lines = head.split(b"\r\n")
        self.assertEqual(lines[0], b"POST /base/logs/a%20log%2Fx/records HTTP/1.1")
        for line in (b"Host: h:7123", b"Connection: upgrade", b"Upgrade: styx/0",
                     b"X-Styx-Timeout: 9", b"Authorization: Bearer t0ken", b"Content-Length: 0"):
            self.assertIn(line, lines)
        self.assertTrue(head.endswith(b"\r\n\r\n"))

    def test_consume_query(self):
        head = request_head("GET", "h", "l", {"whence": "start", "position": 5})
        self.assertTrue(head.startswith(b"GET /logs/l/records?whence=start&position=5 HTTP/1.1"))
        self.assertNotIn(b"Content-Length", head)


class ResponseHeadTests(unittest.SynchronousTestCase):

    @given(st.lists(st.integers(1, 40), max_size=20), st.binary(max_size=50))
    def test_any_cut(self, cuts, after):
        """However the bytes arrive, the same head and the same bytes after it."""
        data = UPGRADE + after
        head = ResponseHead()
        rest, pos = None, 0
        for n in cuts + [len(data)]:
            if rest is not None:
                rest += data[pos:pos + n]
            else:
                rest = head.feed(data[pos:pos + n])
            pos += n
        self.assertEqual(rest, after)
        self.assertEqual(head.status, 101)
        self.assertTrue(upgraded(head.status, head.headers))
        self.assertEqual(remote_timeout(head.headers), 12.0)

    def test_too_large(self):
        head = ResponseHead(max_size=100)
        self.assertIsNone(head.feed(b"HTTP/1.1 200 OK\r\n" + b"x: y\r\n" * 10))
        self.assertRaises(HandshakeError, head.feed, b"x: y\r\n" * 20)

    def test_not_http(self):
        self.assertRaises(HandshakeError, ResponseHead().feed, b"SSH-2.0-x\r\n\r\n")
        self.assertRaises(HandshakeError, parse_response_head, b"HTTP/1.1 abc\r\n")

    def test_refused(self):
        status, headers = parse_response_head(b"HTTP/1.1 404 Not Found\r\nContent-Length: 2")
        self.assertEqual((status, headers), (404, {"content-length": "2"}))
        self.assertFalse(upgraded(status, headers))
        self.assertFalse(upgraded(101, {"upgrade": "websocket"}))

    def test_remote_timeout_default(self):
        self.assertEqual(remote_timeout({}), 30.0)
        self.assertEqual(remote_timeout({"x-styx-timeout": "soon"}, 7), 7.0)
