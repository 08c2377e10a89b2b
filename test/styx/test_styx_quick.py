"""
The quick path of one-record produce requests (L{streamproto.styx.quick}):
its head parser (fuzzed), its answers against twisted.web's for the same
requests, pipelining, ordering, flow control, the hand-over to twisted.web,
and its idle timeout.
"""

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import defer, endpoints, protocol, reactor
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.trial import unittest
from twisted.web.http import _GenericHTTPChannelProtocol

from streamproto.core.auth import PolicyHolder, hash_token
from streamproto.core.interfaces import IGracefulShutdown
from streamproto.core.sendpath import SocketSender
from streamproto.log import LogConfig, MemoryLogStore
from streamproto.log.filestore import FileLogStore
from streamproto.styx.quick import (
    MAX_HEAD, MAX_PIPELINED, MAX_PIPELINED_BYTES, QuickChannel, parse_head,
)
from streamproto.styx.resource import make_site
from test.support import authutil
from test.support.ciutil import missing
from test.support.netutil import wait_until
from test.support.tlsutil import certs

HEAD = (b"POST /logs/events/records HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/octet-stream\r\nContent-Length: %d")


class AppendResult:
    def __init__(self, end_position):
        self.end_position = end_position


def post(body, name=b"events", extra=b""):
    """A one-record produce request for log C{name}."""
    return (b"POST /logs/" + name + b"/records HTTP/1.1\r\nHost: x\r\n" + extra
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def answers(data):
    """The answers in C{data}: [(status, {lowercased header: value}, body)]."""
    out = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get(b"content-length", b"0"))
        body, data = data[:length], data[length:]
        out.append((int(lines[0].split(b" ")[1]), headers, body))
    return out


class ParseHeadTests(unittest.SynchronousTestCase):
    """L{parse_head}: what is a one-record produce request, and what is not."""

    def test_plain(self):
        head = parse_head(HEAD % 5)
        self.assertEqual((head.name, head.length, head.close, head.origin, head.authorization),
                         ("events", 5, False, None, ()))

    def test_no_content_type_is_one_record(self):
        head = parse_head(b"POST /logs/a-b.c_d/records HTTP/1.1\r\nContent-Length: 0")
        self.assertEqual((head.name, head.length), ("a-b.c_d", 0))

    def test_close_origin_authorization(self):
        head = parse_head(HEAD % 1 + b"\r\nConnection: keep-alive, Close\r\n"
                          b"Origin: https://x.example\r\nAuthorization: Bearer t")
        self.assertTrue(head.close)
        self.assertEqual(head.origin, b"https://x.example")
        self.assertEqual(head.authorization, (b"Bearer t",))

    def test_header_names_any_case_values_trimmed(self):
        head = parse_head(b"POST /logs/e/records HTTP/1.1\r\ncOnTeNt-LeNgTh: \t 7 \t")
        self.assertEqual(head.length, 7)

    def test_not_quick(self):
        """Everything twisted.web should answer instead."""
        for head in [
            b"GET /logs/events/records HTTP/1.1\r\nContent-Length: 1",
            b"POST /logs/events/records HTTP/1.0\r\nContent-Length: 1",
            b"POST /logs/events/records?x=1 HTTP/1.1\r\nContent-Length: 1",
            b"POST /logs/ev%20ents/records HTTP/1.1\r\nContent-Length: 1",
            b"POST /logs/a/b/records HTTP/1.1\r\nContent-Length: 1",
            b"POST /logs//records HTTP/1.1\r\nContent-Length: 1",
            b"POST /logs/events HTTP/1.1\r\nContent-Length: 1",
            b"POST  /logs/events/records HTTP/1.1\r\nContent-Length: 1",
            b"POST /logs/events/records HTTP/1.1",
            b"POST /logs/events/records HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1",
            b"POST /logs/events/records HTTP/1.1\r\nContent-Length: -1",
            b"POST /logs/events/records HTTP/1.1\r\nContent-Length: 0x1",
            b"POST /logs/events/records HTTP/1.1\r\nTransfer-Encoding: chunked",
            b"POST /logs/events/records HTTP/1.1\r\nContent-Length: 1\r\nExpect: 100-continue",
            b"POST /logs/events/records HTTP/1.1\r\nContent-Length: 0\r\nUpgrade: styx/0",
            b"POST /logs/events/records HTTP/1.1\r\nContent-Length: 0\r\n"
            b"Connection: Upgrade",
            b"POST /logs/events/records HTTP/1.1\r\nContent-Length: 1\r\n"
            b"Content-Type: application/vnd.styx.line-delimited",
            b"POST /logs/events/records HTTP/1.1\r\nContent-Length: 1\r\n"
            b"Content-Type: application/vnd.styx.binary-records",
            b"POST /logs/events/records HTTP/1.1\r\nContent-Length: 1\r\n folded",
            b"POST /logs/events/records HTTP/1.1\r\nContent-Length : 1",
            b"POST /logs/events/records HTTP/1.1\r\nContent-Length: 1\r\nno colon",
            b"POST /logs/events/records HTTP/1.1\r\nContent-Length: 1\r\nOrigin: a\r\n"
            b"Origin: b",
            b"POST /logs/events/records HTTP/1.1\r\nContent-Length: 65537",
        ]:
            self.assertIsNone(parse_head(head), head)

    def test_body_limit(self):
        self.assertEqual(parse_head(HEAD % 100, max_body=100).length, 100)
        self.assertIsNone(parse_head(HEAD % 101, max_body=100))

    @settings(max_examples=500)
    @given(st.binary(max_size=300))
    def test_any_bytes(self, head):
        """Never raises; whatever it accepts is a POST with a length in bounds."""
        parsed = parse_head(head)
        if parsed is not None:
            self.assertTrue(head.startswith(b"POST /logs/"))
            self.assertLessEqual(parsed.length, 65536)

    @given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1,
                   max_size=40),
           st.integers(0, 65536),
           st.lists(st.sampled_from([b"Host: x", b"User-Agent: Go-http-client/1.1",
                                     b"Accept-Encoding: gzip", b"Connection: keep-alive",
                                     b"Content-Type: text/plain"]), max_size=5))
    def test_generated(self, name, length, others):
        head = (b"POST /logs/" + name.encode() + b"/records HTTP/1.1\r\n"
                + b"".join(h + b"\r\n" for h in others) + b"Content-Length: %d" % length)
        parsed = parse_head(head)
        self.assertEqual((parsed.name, parsed.length), (name, length))


class ChannelTestBase(unittest.SynchronousTestCase):

    def setUp(self):
        self.clock = Clock()
        self.fresh_store()

    def fresh_store(self):
        self.store = MemoryLogStore(self.clock)
        self.log = self.successResultOf(self.store.create(
            "events", LogConfig(max_record_size=100)))
        self.successResultOf(self.store.create("other"))

    def make_site(self, **kw):
        site = make_site(self.store, clock=self.clock, **kw)
        site.reactor = self.clock   # twisted.web's channel timer, after a hand-over
        return site

    def hold_gets(self):
        """
        Make the store's C{get} answer only when the test says: @return:
        the list of its Deferreds, one per call, fired by the test.
        C{del self.store.get} gives the store its own back.
        """
        held = []

        def get(name):
            held.append(defer.Deferred())
            return held[-1]
        self.store.get = get
        return held

    def connect(self, site=None, transport=None):
        site = site or self.make_site()
        channel = site.buildProtocol(None)
        transport = transport or StringTransport()
        channel.makeConnection(transport)
        return channel, transport

    def exchange(self, data, site=None):
        """Everything the server answers to C{data} on one connection."""
        channel, transport = self.connect(site)
        channel.dataReceived(data)
        self.clock.advance(0)
        self.clock.advance(0)
        return transport.value()


class AnswerTests(ChannelTestBase):
    """The quick path answers what twisted.web's path answers."""

    def both(self, data, **kw):
        """C{data}'s answers from the quick path and from twisted.web's."""
        quick = self.exchange(data, self.make_site(**kw))
        self.fresh_store()
        slow = self.exchange(data, self.make_site(quick=False, **kw))
        return answers(quick), answers(slow)

    def assertSameAnswers(self, data, **kw):
        quick, slow = self.both(data, **kw)
        self.assertTrue(quick)
        self.assertEqual(len(quick), len(slow))
        for (q_status, q_headers, q_body), (s_status, s_headers, s_body) in zip(quick, slow):
            self.assertEqual((q_status, q_body), (s_status, s_body))
            for name in (b"date", b"server"):
                self.assertIn(name, q_headers)
                q_headers.pop(name)
                s_headers.pop(name, None)  # not in twisted.web's early refusals
            self.assertEqual(q_headers, s_headers)
        return quick

    def test_the_quick_path_is_taken(self):
        channel, transport = self.connect()
        self.assertIsInstance(channel, QuickChannel)
        channel.dataReceived(post(b"hello"))
        self.clock.advance(0)
        self.assertIs(getattr(transport, "protocol", channel), channel)
        self.assertEqual(answers(transport.value())[0][0], 200)

    def test_record(self):
        quick = self.assertSameAnswers(post(b"one"))
        self.assertEqual(json.loads(quick[0][2]), {"position": 1, "count": 1})
        records = self.successResultOf(self.log.read(0, 10))
        self.assertEqual([bytes(r) for r in records], [b"one"])

    def test_empty_record(self):
        quick = self.assertSameAnswers(post(b""))
        self.assertEqual(json.loads(quick[0][2]), {"position": 0, "count": 0})

    def test_unknown_log(self):
        quick = self.assertSameAnswers(post(b"x", name=b"nosuch"))
        self.assertEqual(quick[0][0], 404)

    def test_invalid_name(self):
        self.assertSameAnswers(post(b"x", name=b"-bad*name"))

    def test_record_too_large(self):
        quick = self.assertSameAnswers(post(b"x" * 101))
        self.assertEqual(json.loads(quick[0][2])["code"], "record_too_large")

    def test_cors(self):
        self.assertSameAnswers(post(b"x", extra=b"Origin: https://app.example\r\n"),
                               cors_origins=["https://app.example"])

    def test_close(self):
        quick = self.assertSameAnswers(post(b"x", extra=b"Connection: close\r\n"))
        self.assertEqual(quick[0][1][b"connection"], b"close")

    def test_policy(self):
        """Unauthorized (401 with its challenge), forbidden (403), allowed."""
        policy = authutil.POLICY + """
[tokens.extra]
[[allow]]
principal = "token:ingest"
logs = ["events"]
ops = ["write"]
"""
        policy = policy.replace("[tokens]\n", '[tokens]\ningest = "%s"\n' %
                                hash_token("ingest-token")).replace("[tokens.extra]\n", "")
        holder = PolicyHolder(authutil.write_policy(self, policy))
        cases = [(b"", 401), (b"Authorization: Bearer dash-token\r\n", 403),
                 (b"Authorization: Bearer nosuch\r\n", 401),
                 (b"Authorization: Bearer ingest-token\r\n", 200)]
        for extra, status in cases:
            quick = self.assertSameAnswers(post(b"x", extra=extra), authorizer=holder)
            self.assertEqual(quick[0][0], status, extra)


class PipelineTests(ChannelTestBase):
    """Pipelined requests: appended at once, answered in order."""

    def hold_appends(self, the_log):
        appends = []

        def append(records):
            appends.append((defer.Deferred(), list(records)))
            return appends[-1][0]
        the_log.append = append
        return appends

    def test_pipelined_records_share_an_append(self):
        """A turn's records go to their log in one append, on any connection."""
        appends = self.hold_appends(self.log)
        site = self.make_site()
        (one, one_transport), (two, two_transport) = self.connect(site), self.connect(site)
        one.dataReceived(b"".join(post(b"r%d" % i) for i in range(3)))
        two.dataReceived(post(b"r3") + post(b"r4"))
        self.assertEqual(appends, [])
        self.clock.advance(0)
        self.assertEqual([records for _, records in appends],
                         [[b"r0", b"r1", b"r2", b"r3", b"r4"]])
        self.assertEqual(one_transport.value() + two_transport.value(), b"")
        appends[0][0].callback(AppendResult(5))
        got = answers(one_transport.value()) + answers(two_transport.value())
        self.assertEqual([json.loads(b) for _, _, b in got], [{"position": 5, "count": 1}] * 5)

    def test_metrics_counted_once_a_batch(self):
        """The produced records and bytes are counted once the batch is
        acknowledged, per log, and a failed append counts nothing."""
        site = self.make_site()
        counted = []
        site.append_batcher.on_appended = lambda *args: counted.append(args)
        appends = self.hold_appends(self.log)
        channel, transport = self.connect(site)
        channel.dataReceived(post(b"a") + post(b"bb") + post(b"ccc"))
        self.clock.advance(0)
        self.assertEqual(counted, [])           # not before it is durable
        appends[0][0].callback(AppendResult(3))
        self.assertEqual(counted, [("events", 3, 6)])
        channel.dataReceived(post(b"d"))
        self.clock.advance(0)
        appends[1][0].errback(OSError(28, "No space left on device"))
        self.assertEqual(counted, [("events", 3, 6)])
        self.flushLoggedErrors(OSError)

    def test_metrics_reach_the_servers_counters(self):
        site = self.make_site()
        channel, transport = self.connect(site)
        channel.dataReceived(post(b"a") + post(b"bb"))
        self.clock.advance(0)
        self.assertEqual(len(answers(transport.value())), 2)
        registry = site.resource.metrics.registry
        self.assertEqual(registry.get_sample_value(
            "styx_records_produced_total", {"log": "events"}), 2)
        self.assertEqual(registry.get_sample_value(
            "styx_bytes_produced_total", {"log": "events"}), 3)

    def test_one_append_a_log(self):
        other = self.successResultOf(self.store.get("other"))
        events, others = self.hold_appends(self.log), self.hold_appends(other)
        channel, _ = self.connect()
        channel.dataReceived(post(b"a") + post(b"b", name=b"other") + post(b"c"))
        self.clock.advance(0)
        self.assertEqual([records for _, records in events], [[b"a", b"c"]])
        self.assertEqual([records for _, records in others], [[b"b"]])

    def test_a_failed_append_fails_each_of_its_records(self):
        appends = self.hold_appends(self.log)
        channel, transport = self.connect()
        channel.dataReceived(post(b"a") + post(b"b"))
        self.clock.advance(0)
        appends[0][0].errback(OSError(28, "No space left on device"))
        got = answers(transport.value())
        self.assertEqual([s for s, _, _ in got], [500, 500])
        self.assertIn(b"ENOSPC", got[1][2])
        self.flushLoggedErrors(OSError)

    def test_an_append_that_raises(self):
        """A log whose append raises fails its own records only."""
        other = self.successResultOf(self.store.get("other"))

        def append(records):
            raise OSError(5, "Input/output error")
        other.append = append
        channel, transport = self.connect()
        channel.dataReceived(post(b"a", name=b"other") + post(b"b"))
        self.clock.advance(0)
        got = answers(transport.value())
        self.assertEqual([s for s, _, _ in got], [500, 200])
        self.assertEqual(self.log.end_position, 1)
        self.flushLoggedErrors(OSError)

    def test_a_get_that_raises(self):
        def get(name):
            raise RuntimeError("a store bug")
        self.store.get = get
        channel, transport = self.connect()
        channel.dataReceived(post(b"a") + post(b"b"))
        self.clock.advance(0)
        self.assertEqual([s for s, _, _ in answers(transport.value())], [500, 500])
        self.assertFalse(transport.disconnecting)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 2)

    def test_answers_in_the_requests_order(self):
        """Durable in any order, answered in the requests' order."""
        other = self.successResultOf(self.store.get("other"))
        events, others = self.hold_appends(self.log), self.hold_appends(other)
        channel, transport = self.connect()
        channel.dataReceived(post(b"a") + post(b"b", name=b"other"))
        self.clock.advance(0)
        others[0][0].callback(AppendResult(7))
        self.assertEqual(transport.value(), b"")
        events[0][0].callback(AppendResult(3))
        got = answers(transport.value())
        self.assertEqual([json.loads(b)["position"] for _, _, b in got], [3, 7])

    def test_answers_in_request_order(self):
        """A later request's answer waits for an earlier one's."""
        channel, transport = self.connect()
        held = defer.Deferred()
        real_get = self.store.get
        self.store.get = lambda name: held if name == "other" else real_get(name)
        channel.dataReceived(post(b"slow", name=b"other") + post(b"fast"))
        self.clock.advance(0)
        self.assertEqual(transport.value(), b"")
        held.callback(self.successResultOf(real_get("other")))
        self.clock.advance(0)
        got = answers(transport.value())
        self.assertEqual([json.loads(b)["count"] for _, _, b in got], [1, 1])
        self.assertEqual(json.loads(got[0][2])["position"],
                         self.successResultOf(real_get("other")).end_position)

    def test_split_anywhere(self):
        data = post(b"abc") + post(b"") + post(b"defg")
        channel, transport = self.connect()
        for i in range(len(data)):
            channel.dataReceived(data[i:i + 1])
        self.clock.advance(0)
        self.assertEqual([s for s, _, _ in answers(transport.value())], [200, 200, 200])
        records = self.successResultOf(self.log.read(0, 10))
        self.assertEqual([bytes(r) for r in records], [b"abc", b"defg"])

    def test_bounded(self):
        """Past MAX_PIPELINED unanswered requests the connection is not read."""
        channel, transport = self.connect()
        held = self.hold_gets()
        channel.dataReceived(b"".join(post(b"x") for i in range(MAX_PIPELINED + 10)))
        self.assertEqual(transport.producerState, "paused")
        self.assertEqual(len(held), MAX_PIPELINED)
        del self.store.get
        for d in held:
            d.callback(self.log)
        self.clock.advance(0)
        self.clock.advance(0)
        self.assertEqual(transport.producerState, "producing")
        self.assertEqual(len(answers(transport.value())), MAX_PIPELINED + 10)

    def test_bounded_in_bytes(self):
        """Unanswered bodies past MAX_PIPELINED_BYTES: not read either."""
        big = self.successResultOf(self.store.create("big", LogConfig()))
        channel, transport = self.connect()
        held = self.hold_gets()
        body = b"x" * 60000
        channel.dataReceived(b"".join(post(body, name=b"big") for i in range(30)))
        self.assertEqual(transport.producerState, "paused")
        # the one that reached the bound was read, none after it
        self.assertEqual(len(held), MAX_PIPELINED_BYTES // len(body) + 1)
        del self.store.get
        for d in held:
            d.callback(big)
        for _ in range(4):
            self.clock.advance(0)
        self.assertEqual(transport.producerState, "producing")
        self.assertEqual([s for s, _, _ in answers(transport.value())], [200] * 30)
        self.assertEqual(big.end_position, 30)

    def test_client_not_reading(self):
        """The transport's full write buffer stops the reading."""
        channel, transport = self.connect()
        self.assertIs(transport.producer, channel)
        channel.pauseProducing()  # what a full write buffer does
        self.assertEqual(transport.producerState, "paused")
        channel.dataReceived(post(b"x"))
        self.clock.advance(0)
        self.assertEqual(transport.value(), b"")  # not parsed while blocked
        channel.resumeProducing()
        self.clock.advance(0)
        self.assertEqual(transport.producerState, "producing")
        self.assertEqual(len(answers(transport.value())), 1)

    def test_client_gone_with_answers_due(self):
        channel, transport = self.connect()
        held = defer.Deferred()
        self.store.get = lambda name: held
        channel.dataReceived(post(b"a") + post(b"b"))
        channel.connectionLost(None)
        held.callback(self.log)
        self.clock.advance(0)
        self.assertEqual(transport.value(), b"")
        # nobody waits for them: not appended (as on twisted.web's path)
        self.assertEqual(self.log.end_position, 0)

    def test_nothing_read_after_close(self):
        channel, transport = self.connect()
        channel.dataReceived(post(b"a", extra=b"Connection: close\r\n") + post(b"b"))
        self.clock.advance(0)
        self.assertEqual(len(answers(transport.value())), 1)
        self.assertTrue(transport.disconnecting)
        self.assertEqual(self.log.end_position, 1)


class HandOverTests(ChannelTestBase):
    """The first other request goes to twisted.web, with the connection."""

    def test_other_request(self):
        channel, transport = self.connect()
        channel.dataReceived(post(b"a") + b"GET /logs/events HTTP/1.1\r\nHost: x\r\n\r\n")
        self.clock.advance(0)
        self.assertIsInstance(transport.protocol, _GenericHTTPChannelProtocol)
        first, second = answers(transport.value())
        self.assertEqual(json.loads(first[2])["count"], 1)
        self.assertEqual(json.loads(second[2])["name"], "events")
        # the new channel keeps the connection: more requests work
        transport.protocol.dataReceived(post(b"b"))
        self.clock.advance(0)
        self.assertEqual(len(answers(transport.value())), 3)

    def test_waits_for_answers_due(self):
        """twisted.web gets the connection once every quick answer is out."""
        channel, transport = self.connect()
        held = defer.Deferred()
        self.store.get = lambda name: held
        channel.dataReceived(post(b"a") + b"GET /logs HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertIs(getattr(transport, "protocol", channel), channel)
        self.assertEqual(transport.producerState, "paused")
        del self.store.get
        held.callback(self.log)
        self.clock.advance(0)
        self.assertIsInstance(transport.protocol, _GenericHTTPChannelProtocol)
        self.assertEqual(transport.producerState, "producing")
        self.assertEqual([s for s, _, _ in answers(transport.value())], [200, 200])

    def test_batch_body(self):
        data = (b"POST /logs/events/records HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/vnd.styx.line-delimited\r\nContent-Length: 4\r\n\r\na\nb\n")
        self.assertEqual(json.loads(answers(self.exchange(data))[0][2])["count"], 2)

    def test_long_head(self):
        """A head longer than twisted.web's limit: twisted.web refuses it."""
        channel, transport = self.connect()
        channel.dataReceived(b"POST /logs/events/records HTTP/1.1\r\nX: "
                             + b"y" * MAX_HEAD)
        self.assertIsInstance(transport.protocol, _GenericHTTPChannelProtocol)
        self.assertEqual(transport.value(), b"")
        self.assertTrue(transport.disconnecting)

    def test_off(self):
        for site in (self.make_site(quick=False), self.make_site(access_log=True)):
            self.assertNotIsInstance(site.buildProtocol(None), QuickChannel)


class IdleTests(ChannelTestBase):

    def test_idle_connection_closed(self):
        channel, transport = self.connect(self.make_site(http_idle_timeout=10))
        self.clock.advance(9)
        channel.dataReceived(post(b"a"))
        self.clock.advance(0)
        self.clock.advance(9.5)
        self.assertFalse(transport.disconnecting)
        self.clock.advance(1)
        self.assertTrue(transport.disconnecting)

    def test_not_while_answering(self):
        channel, transport = self.connect(self.make_site(http_idle_timeout=10))
        held = defer.Deferred()
        self.store.get = lambda name: held
        channel.dataReceived(post(b"a"))
        self.clock.advance(30)
        self.assertFalse(transport.disconnecting)
        del self.store.get
        held.callback(self.log)
        self.clock.advance(0)
        self.clock.advance(9)
        self.assertFalse(transport.disconnecting)
        self.clock.advance(2)
        self.assertTrue(transport.disconnecting)


class ShutdownTests(ChannelTestBase):
    """A stopping server answers what it read, then closes."""

    def test_answers_then_closes(self):
        channel, transport = self.connect()
        held = defer.Deferred()
        self.store.get = lambda name: held
        channel.dataReceived(post(b"a"))
        self.assertTrue(IGracefulShutdown.providedBy(channel))
        done = channel.gracefulShutdown()
        channel.dataReceived(post(b"b"))  # not read any more
        self.assertFalse(transport.disconnecting)
        del self.store.get
        held.callback(self.log)
        self.clock.advance(0)
        self.assertEqual([s for s, _, _ in answers(transport.value())], [200])
        self.assertTrue(transport.disconnecting)
        self.assertNoResult(done)
        channel.connectionLost(None)
        self.successResultOf(done)
        self.assertEqual(self.log.end_position, 1)

    def test_idle_connection_closes_at_once(self):
        channel, transport = self.connect()
        done = channel.gracefulShutdown()
        self.assertTrue(transport.disconnecting)
        channel.connectionLost(None)
        self.successResultOf(done)


class _Collect(protocol.Protocol):
    def __init__(self):
        self.data = b""
        self.closed = defer.Deferred()

    def dataReceived(self, data):
        self.data += data

    def connectionLost(self, reason):
        self.closed.callback(self.data)


class RealConnectionTests(unittest.TestCase):
    """Over real TCP, where answers go out by L{SocketSender}."""

    timeout = 20

    @defer.inlineCallbacks
    def setUp(self):
        self.store = MemoryLogStore()
        self.log = yield self.store.create("events")
        self.site = make_site(self.store)
        self.port = yield endpoints.serverFromString(reactor, self.server).listen(self.site)
        self.addCleanup(self.port.stopListening)

    server = "tcp:0:interface=127.0.0.1"

    def client_endpoint(self):
        return endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", self.port.getHost().port)

    @defer.inlineCallbacks
    def exchange(self, data):
        client = yield endpoints.connectProtocol(self.client_endpoint(), _Collect())
        client.transport.write(data)
        received = yield client.closed
        return answers(received)

    @defer.inlineCallbacks
    def test_close_after_answer(self):
        """The server closes (its duplicate descriptor too: the FIN goes)."""
        got = yield self.exchange(post(b"a") + post(b"b", extra=b"Connection: close\r\n"))
        self.assertEqual([json.loads(b)["count"] for _, _, b in got], [1, 1])
        self.assertEqual(got[1][1][b"connection"], b"close")
        self.assertEqual(self.log.end_position, 2)

    @defer.inlineCallbacks
    def test_hand_over_after_direct_answers(self):
        got = yield self.exchange(post(b"a") + post(b"b")
                                  + b"GET /logs/events HTTP/1.1\r\nHost: x\r\n"
                                    b"Connection: close\r\n\r\n")
        self.assertEqual([s for s, _, _ in got], [200, 200, 200])
        self.assertEqual(json.loads(got[2][2])["end_position"], 2)

    @defer.inlineCallbacks
    def test_many_pipelined(self):
        n = MAX_PIPELINED * 3
        got = yield self.exchange(b"".join(post(b"%d" % i) for i in range(n))
                                  + post(b"last", extra=b"Connection: close\r\n"))
        self.assertEqual(len(got), n + 1)
        records = yield self.log.read(0, n + 1)
        self.assertEqual([bytes(r) for r in records][-2:], [b"%d" % (n - 1), b"last"])

    @defer.inlineCallbacks
    def test_bad_request_after_answers(self):
        """A head nobody understands, after good requests: they are answered
        and acknowledged, then twisted.web refuses it and closes; another
        client is unaffected."""
        got = yield self.exchange(post(b"a") + b"NONSENSE\r\n\r\n")
        self.assertEqual([s for s, _, _ in got], [200, 400])
        got = yield self.exchange(post(b"b", extra=b"Connection: close\r\n"))
        self.assertEqual([s for s, _, _ in got], [200])
        records = yield self.log.read(0, 2)
        self.assertEqual([bytes(r) for r in records], [b"a", b"b"])


class RealTLSConnectionTests(RealConnectionTests):
    """The same over TLS (client certificates asked for), where answers go
    through the TLS transport's write."""

    server = certs().server_endpoint()

    def client_endpoint(self):
        return endpoints.wrapClientTLS(certs().client_options(), super().client_endpoint())


class HeldAnswerTests(unittest.TestCase):
    """
    Over real TCP on the file store with the accelerator: a connection's
    next answer is made before its fsync and sent from the fsync's thread
    (L{streamproto.core.sendpath.SocketSender.hold}); the others the usual
    way, every answer once, in order.
    """

    timeout = 30

    @defer.inlineCallbacks
    def setUp(self):
        from streamproto.core import sendthread
        from streamproto.log import syncer
        if sendthread._SendThread is None or syncer._Syncer is None:
            missing("the C accelerator's SendThread and Syncer (setup.py build_ext, Linux)")
        self.store = FileLogStore(self.mktemp())
        self.addCleanup(self.store.close)
        self.log = yield self.store.create("events")
        self.site = make_site(self.store)
        self.port = yield endpoints.serverFromString(
            reactor, "tcp:0:interface=127.0.0.1").listen(self.site)
        self.addCleanup(self.port.stopListening)
        self.held = []
        real = SocketSender.finish_held

        def finish_held(sender, held, size):
            sent = real(sender, held, size)
            self.held.append(sent)
            return sent
        self.patch(SocketSender, "finish_held", finish_held)

    @defer.inlineCallbacks
    def exchange(self, *requests):
        """Send each request once the answer before it is in; the answers."""
        client = yield endpoints.connectProtocol(
            endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", self.port.getHost().port),
            _Collect())
        for i, request in enumerate(requests):
            client.transport.write(request)
            if i < len(requests) - 1:
                yield wait_until(lambda i=i: len(answers(client.data)) > i)
        received = yield client.closed
        return answers(received)

    @defer.inlineCallbacks
    def test_one_at_a_time_from_the_fsync_thread(self):
        got = yield self.exchange(post(b"a"), post(b"b"),
                                  post(b"c", extra=b"Connection: close\r\n"))
        self.assertEqual([(s, json.loads(b)) for s, _, b in got],
                         [(200, {"position": p, "count": 1}) for p in (1, 2, 3)])
        # the two not closing the connection were held (the last is written
        # as twisted.web would: it closes)
        self.assertEqual(self.held, [True, True])
        records = yield self.log.read(0)
        self.assertEqual([bytes(r) for r in records], [b"a", b"b", b"c"])

    @defer.inlineCallbacks
    def test_pipelined_in_order(self):
        n = 40
        got = yield self.exchange(b"".join(post(b"%d" % i) for i in range(n))
                                  + post(b"last", extra=b"Connection: close\r\n"))
        self.assertEqual([s for s, _, _ in got], [200] * (n + 1))
        positions = [json.loads(b)["position"] for _, _, b in got]
        self.assertEqual(positions, sorted(positions))
        self.assertEqual(positions[-1], n + 1)
        self.assertIn(True, self.held)        # the first, at least
        self.assertEqual(self.log.end_position, n + 1)

    @defer.inlineCallbacks
    def test_a_failed_fsync_answers_once(self):
        syncer = self.store._syncer
        real = syncer.sync
        self.patch(syncer, "sync", lambda fds, directory, *rest:
                   real([10 ** 6], directory, *rest))
        got = yield self.exchange(post(b"a"), post(b"b", extra=b"Connection: close\r\n"))
        # the first was held, then cancelled: answered here, once, with the
        # error (and the log, fail-stopped, refuses the next)
        self.assertEqual(self.held, [False])
        self.assertEqual(len(got), 2)
        self.assertEqual([(s, json.loads(b)["code"]) for s, _, b in got],
                         [(400, "log_not_available")] * 2)
