"""
Acknowledged means stored, on a real nats-server cluster, through the
Styx HTTP API (the defects a user found, each a test that failed before
the fix):

  - a batch produce answered 200 only once its records are stored, with
    their count and position; with the server paused, an error within the
    store's timeout, never a 200;
  - front-ends racing appends on one log: every batch one of them
    acknowledged is read back, once, where it was told, through a
    front-end started afterwards, and every front-end serves what the
    cluster holds.

Each front-end is a L{JetStreamLogStore} of its own (its own connection
and writer id) with its own HTTP site, as C{twistd styx-server --store
nats://...} processes are.
"""

import json
import time

import treq
from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.task import deferLater
from twisted.trial import unittest
from twisted.web.client import HTTPConnectionPool

from streamproto.log.jetstream import JetStreamLogStore
from test.support.logutil import read_records
from test.support.natsutil import NatsCluster

LINES = "application/vnd.styx.line-delimited"


def sleep(seconds):
    return deferLater(reactor, seconds, lambda: None)


class FrontEnds(unittest.TestCase):
    """Styx HTTP front-ends on one cluster."""

    timeout = 240
    size = 1

    def setUp(self):
        self.cluster = NatsCluster(self.size).start()
        self.addCleanup(self.cluster.stop)
        self.pool = HTTPConnectionPool(reactor, persistent=True)
        self.addCleanup(self.pool.closeCachedConnections)

    @defer.inlineCallbacks
    def front_end(self, name, timeout=5.0):
        """A store and an HTTP site on it: (store, base URL)."""
        from streamproto.styx.resource import make_site
        store = JetStreamLogStore(self.cluster.urls, replicas=self.size, prefix="acks",
                                  timeout=timeout, retention_interval=None,
                                  connection_name=name)
        self.addCleanup(store.close)
        yield store.start()
        port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
            make_site(store))
        self.addCleanup(port.stopListening)
        return store, f"http://127.0.0.1:{port.getHost().port}"

    @defer.inlineCallbacks
    def post(self, base, name, lines, timeout=60):
        """POST C{lines}: (status, JSON answer)."""
        response = yield treq.post(f"{base}/logs/{name}/records",
                                   data=b"".join(line + b"\n" for line in lines),
                                   headers={"Content-Type": LINES}, pool=self.pool,
                                   timeout=timeout)
        body = yield response.content()
        return response.code, json.loads(body)

    @defer.inlineCallbacks
    def fresh_read(self, name):
        """What a front-end started now reads."""
        store, _ = yield self.front_end(f"fresh-{time.monotonic()}")
        records = yield read_records(store, name)
        return records


class ProduceAnswerTests(FrontEnds):

    @defer.inlineCallbacks
    def test_answer_counts_what_is_stored(self):
        """
        Each answer counts the body's records and gives the log's end after
        them (it was C{count: 0} and the position before, at once); with
        the server paused, an error within the store's timeout and some,
        never a 200; what was answered 200 is read back by a fresh
        front-end once the server runs again.
        """
        store, base = yield self.front_end("a", timeout=3.0)
        yield store.create("events")
        acked = []
        for b in range(3):
            lines = [b"b%d-%d" % (b, i) for i in range(10)]
            status, answer = yield self.post(base, "events", lines)
            self.assertEqual(status, 200, answer)
            self.assertEqual(answer, {"position": 10 * (b + 1), "count": 10})
            acked.extend(lines)
        self.cluster.pause(0)
        try:
            for b in range(3, 5):
                lines = [b"b%d-%d" % (b, i) for i in range(10)]
                started = time.monotonic()
                status, answer = yield self.post(base, "events", lines)
                waited = time.monotonic() - started
                self.assertNotEqual(status, 200, answer)
                self.assertEqual(answer["code"], "log_not_available", answer)
                self.assertLess(waited, 3.0 + 5.0)
        finally:
            self.cluster.resume(0)
        deadline = time.monotonic() + 60
        while True:
            lines = [b"after-%d" % i for i in range(10)]
            status, answer = yield self.post(base, "events", lines)
            if status == 200:
                self.assertEqual(answer["count"], 10)
                acked.extend(lines)
                break
            self.assertLess(time.monotonic(), deadline, answer)
            yield sleep(0.5)
        stored = yield self.fresh_read("events")
        for line in acked:
            self.assertEqual(stored.count(line), 1, line)
        self.assertEqual(answer["position"], len(stored))


class RacingFrontEndsTests(FrontEnds):
    """
    Two front-ends, four HTTP writers each, on one log (R3, every write
    fsynced): concurrent requests make each front-end's chain hold several
    appends at once, which is when a message refused for the other
    front-end's sake had the next one stored after it.
    """

    size = 3

    @defer.inlineCallbacks
    def test_racing_writers_lose_nothing(self):
        stores = []
        bases = []
        for name in ("a", "b"):
            store, base = yield self.front_end(name, timeout=20.0)
            stores.append(store)
            bases.append(base)
        yield stores[0].create("race")
        acked = []       # (writer, batch, position, lines)
        failed = []

        @defer.inlineCallbacks
        def writer(w, until, round_):
            n = 0
            while time.monotonic() < until:
                lines = [b"w%d-r%d-b%d-%d" % (w, round_, n, i) for i in range(10)]
                try:
                    status, answer = yield self.post(bases[w % 2], "race", lines)
                except Exception as e:  # noqa: BLE001 - counted, not retried
                    failed.append((w, n, repr(e)))
                else:
                    if status == 200:
                        acked.append((w, (round_, n), answer["position"], lines))
                    else:
                        failed.append((w, n, answer))
                n += 1
        for round_ in range(3):
            until = time.monotonic() + 4
            # writer w posts through front-end w % 2
            yield defer.gatherResults([writer(w, until, round_) for w in range(8)])
        print(f"\nracing front-ends: {len(acked)} batches acknowledged, {len(failed)} failed")
        self.assertGreater(len(acked), 20)
        stored = yield self.fresh_read("race")
        self.assertEqual(len(stored), len(set(stored)), "a record stored twice")
        at = {record: i for i, record in enumerate(stored)}
        orders = {w: [] for w in range(8)}
        for w, n, position, lines in acked:
            self.assertIn(lines[0], at, f"writer {w} batch {n} acknowledged, not stored")
            first = at[lines[0]]
            self.assertEqual(stored[first:first + 10], lines, f"writer {w} batch {n} cut")
            # the answer's position is the log's end when it was acknowledged
            self.assertLessEqual(first + 10, position)
            orders[w].append(first)
        for w, positions in orders.items():
            self.assertEqual(positions, sorted(positions), f"writer {w}: out of order")
        for store in stores:
            log = yield store.get("race")
            self.assertEqual(log.info()["status"], "ok")
            served = yield read_records(store, "race")
            self.assertEqual(served, stored)
