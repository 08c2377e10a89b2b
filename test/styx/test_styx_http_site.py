"""
The Styx HTTP site's own per-request work: the access log only when asked
for, and no parsing of POST bodies into C{request.args}.
"""

from twisted.internet import defer, protocol, reactor
from twisted.trial import unittest

from streamproto.log.memory import MemoryLogStore
from streamproto.styx.errors import render_json, render_produced
from streamproto.styx.resource import StyxResource, StyxSite

from test.styx.test_styx_http import HTTPTestBase, RawHTTP


class AccessLogTests(unittest.TestCase):
    """One formatted line a request costs a tenth of a small request's time."""

    @defer.inlineCallbacks
    def served_lines(self, **kw):
        lines = []

        def formatter(timestamp, request):
            lines.append(request.uri)
            return "line"
        site = StyxSite(StyxResource(MemoryLogStore()), logFormatter=formatter, **kw)
        port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        proto = yield protocol.ClientCreator(reactor, RawHTTP, (
            b"GET /logs HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")).connectTCP(
                "127.0.0.1", port.getHost().port)
        answer = yield proto.done
        self.assertTrue(answer.startswith(b"HTTP/1.1 200 "), answer)
        return lines

    @defer.inlineCallbacks
    def test_off_by_default(self):
        self.assertEqual((yield self.served_lines()), [])

    @defer.inlineCallbacks
    def test_on_when_asked(self):
        self.assertEqual((yield self.served_lines(access_log=True)), [b"/logs"])


class FormBodyTests(HTTPTestBase):
    """Parameters come from the query only, as in the reference."""

    @defer.inlineCallbacks
    def test_form_body_is_not_parameters(self):
        yield self.make_log("events")
        body = b"position=3&whence=end"
        yield self.raw(
            b"POST /logs/events/records?position=1 HTTP/1.1\r\nHost: x\r\n"
            b"Connection: close\r\nUpgrade: styx/0\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body)
        [(method, name, params, kwargs)] = self.upgrades
        self.assertEqual((params.whence, params.position), ("origin", 1))


class ProducedAnswerTests(unittest.SynchronousTestCase):
    """The produce answer, formatted directly, is the reference's JSON."""

    def test_same_bytes_as_render_json(self):
        for position, count in [(0, 0), (1, 1), (123456789012, 16384), (None, 0)]:
            self.assertEqual(render_produced(position, count),
                             render_json({"position": position, "count": count}))


class AccessLogOptionTests(unittest.SynchronousTestCase):
    def test_flag(self):
        from streamproto.styx.tap import Options, StyxServerConfig
        configs = []
        for argv in ([], ["--access-log"]):
            options = Options()
            options.parseOptions(argv)
            configs.append(StyxServerConfig.from_options(options).access_log)
        self.assertEqual(configs, [False, True])
