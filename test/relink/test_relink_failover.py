"""
A Relink connector moving to a listener that does not know its link
(another front-end of the same store, a restarted listener, one that
discarded the link), in memory on a Clock (L{test.support.memnet} through
L{test.relink.test_relink_support.Pair}): the same L{Link} goes on under the new
link id, and everything the old listener had not acknowledged consumed is
sent again, in order, operations in their places.
"""

import random

from twisted.internet.defer import Deferred
from twisted.trial.unittest import SynchronousTestCase

from streamproto.relink.api import Relinked
from streamproto.relink.codec import RECEIVED
from streamproto.relink.errors import CommitOutcomeUnknown
from test.support.memnet import SERVER
from test.relink.test_relink_support import Pair, Recorder


def fired(d):
    results = []
    d.addBoth(results.append)
    return results


class Failover(SynchronousTestCase):

    def test_unacknowledged_messages_are_resent_in_order(self):
        p = Pair(server=Recorder(hold=True)).connect()
        link = p.link
        ch1, ch2 = link.channel(1), link.channel(2)
        first = fired(ch1.send_payloads([b"a%d" % i for i in range(5)]))
        p.run()
        p.server.release()
        p.run()
        self.assertEqual(first, [5])
        # held by the first listener: received, never consumed
        rest = fired(ch1.send_payloads([b"a%d" % i for i in range(5, 10)]))
        received = fired(ch2.send([b"b0", b"part"], ack=RECEIVED))
        consumed = fired(ch2.send([b"b1"]))
        p.run()
        self.assertEqual(received, [1])
        self.assertEqual((ch1.received, ch1.consumed), (10, 5))
        relinked = fired(p.connector.when_relinked())
        server = p.fail_over()
        p.connect()
        self.assertIs(p.link, link)
        self.assertIsNone(link.lost)
        self.assertEqual(relinked, [Relinked(1, 1, 1_000_000, 1, 7, 2)])
        self.assertEqual(server.messages, {1: [(b"a%d" % i,) for i in range(5, 10)],
                                           2: [(b"b0", b"part"), (b"b1",)]})
        self.assertEqual((rest, consumed), ([10], [2]))
        self.assertEqual(server.attached, [False])
        # counts go on from where they were; the wire starts from 0
        more = fired(ch1.send([b"a10"]))
        p.run()
        self.assertEqual(more, [11])
        self.assertEqual(p.server_link.in_channels[1].consumed, 6)

    def test_resumption_on_the_new_listener(self):
        """The shifted wire numbers survive a cut and resume on the new listener."""
        p = Pair(server=Recorder(hold=True)).connect()
        ch = p.link.channel(3)
        fired(ch.send_payloads([b"%d" % i for i in range(4)]))
        p.run()
        p.server.release()
        p.run()
        d = fired(ch.send_payloads([b"%d" % i for i in range(4, 8)]))
        p.run()
        server = p.fail_over(Recorder(hold=True))
        p.connect()
        server.release()
        p.run()
        self.assertEqual(d, [8])
        later = fired(ch.send_payloads([b"%d" % i for i in range(8, 12)]))
        p.run()
        p.cut()
        p.connect()     # resumed: the acks of the resumption carry wire numbers
        self.assertEqual(p.client.attached[-1], True)
        server.release()
        p.run()
        self.assertEqual(later, [12])
        self.assertEqual([m[0] for m in server.messages[3]],
                         [b"%d" % i for i in range(4, 12)])

    def test_stored_without_the_ack_is_delivered_twice(self):
        """
        What the old listener consumed but whose acknowledgement never
        reached us is sent again: at least once, never lost.
        """
        p = Pair().connect()
        ch = p.link.channel(1)
        d = fired(ch.send_payloads([b"x", b"y"]))
        p.clock.advance(0)
        p.conn.send(SERVER)   # delivered and consumed by the listener, the ack not yet back
        old = p.server
        self.assertEqual(old.messages, {1: [(b"x",), (b"y",)]})
        server = p.fail_over()
        p.connect()
        self.assertEqual(server.messages, {1: [(b"x",), (b"y",)]})
        self.assertEqual(d, [2])
        self.assertEqual(p.connector.last_relink.resent, 2)

    def test_unanswered_commits_are_not_sent_to_the_new_listener(self):
        """
        Commits the old listener had and never answered may have been
        carried out: their outcome is unknown (sending them again could
        commit them twice); what follows goes to the new listener.
        """
        never = Recorder(commit_result=lambda channel, messages: Deferred())
        p = Pair(server=never, transactions=(True, False)).connect()
        ch = p.link.channel(4)
        ch.send_many([[b"t1"], [b"t2"]], ack=None)
        committed = fired(ch.commit())
        p.run()
        self.assertEqual(never.commits, [(4, 2)])
        ch.send_many([[b"t3"]], ack=None)
        rolled = fired(ch.rollback())
        ch.send_many([[b"t4"]], ack=None)
        second = fired(ch.commit())
        p.run()
        self.assertEqual((committed, rolled, second), ([], [], []))
        server = p.fail_over()
        p.connect()
        self.assertEqual([type(f.value) for f in committed + second],
                         [CommitOutcomeUnknown, CommitOutcomeUnknown])
        self.assertEqual(rolled, [None])
        self.assertEqual(server.committed, {})
        self.assertEqual(p.connector.last_relink.resent, 0)
        # and on: the explicit commit numbers are the new link's
        ch.send_many([[b"t5"]], ack=None)
        third = fired(ch.commit())
        p.run()
        self.assertEqual(third, [True])
        self.assertEqual(server.committed, {4: [(b"t5",)]})
        self.assertEqual(server.commits, [(4, 1)])

    def test_transactions_not_yet_sent_are_committed_on_the_new_listener(self):
        p = Pair(server=Recorder(), transactions=(True, False)).connect()
        ch = p.link.channel(4)
        ch.send_many([[b"t1"]], ack=None)
        first = fired(ch.commit())
        p.run()
        self.assertEqual(first, [True])
        p.cut()
        ch.send_many([[b"t2"], [b"t3"]], ack=None)
        second = fired(ch.commit())
        server = p.fail_over()
        p.connect()
        self.assertEqual(second, [True])
        self.assertEqual(server.committed, {4: [(b"t2",), (b"t3",)]})

    def test_a_closing_channel_is_closed_on_the_new_listener(self):
        p = Pair(server=Recorder(hold=True)).connect()
        ch = p.link.channel(5)
        ch.send([b"last"], ack=None)
        closed = fired(ch.close())
        p.run()
        server = p.fail_over()
        p.connect()
        self.assertEqual(closed, [None])
        self.assertEqual(server.messages, {5: [(b"last",)]})
        self.assertEqual(server.closed, [5])
        again = fired(p.link.channel(5).send([b"reopened"]))
        p.run()
        self.assertEqual(again, [1])

    def test_the_old_listeners_channels_are_dropped(self):
        """A batch our handler still holds from the old listener acks nothing on the new one."""
        client = Recorder(hold=True)
        p = Pair(client=client).connect()
        p.server_link.channel(9).send([b"from the old"], ack=None)
        p.run()
        self.assertEqual(len(client.held), 1)
        p.fail_over()
        p.connect()
        self.assertEqual(p.link.in_channels, {})
        client.release()
        p.run()
        self.assertTrue(p.connected)
        self.assertIsNone(p.server_link.lost)

    def test_failover_off_discards(self):
        p = Pair(server=Recorder(hold=True))
        p.connector.failover = False
        p.connect()
        old = p.link
        d = fired(old.channel(1).send([b"x"]))
        p.run()
        p.fail_over()
        p.connect()
        self.assertIsNot(p.link, old)
        self.assertEqual(len(d), 1)
        self.assertEqual(p.connector.relinks, 0)
        self.flushLoggedErrors()

    def test_random_cuts_and_failovers(self):
        """
        Cut at random byte positions, sometimes moving to another listener:
        every message acknowledged, each delivered at least once, the
        first deliveries in order, duplicates only where an ack was lost
        with its listener.
        """
        rng = random.Random(7)
        for seed in range(20):
            p = Pair(server=Recorder(rng=random.Random(seed)), seed=seed).connect()
            servers = [p.server]
            ch = p.link.channel(1)
            results, ends = [], []
            n = 0
            for _ in range(12):
                batch = [b"%d" % i for i in range(n, n + rng.randint(1, 30))]
                n += len(batch)
                ends.append(n)
                results.append(fired(ch.send_payloads(batch)))
                p.step(chunk=40)
                p.cut(rng=rng)
                for s in servers:
                    s.release()
                if rng.random() < 0.4:
                    servers.append(p.fail_over(Recorder(rng=random.Random(seed + 100))))
                p.connect()
                for _ in range(5):
                    for s in servers:
                        s.release()
                    p.run()
            for _ in range(20):
                for s in servers:
                    s.release()
                p.run()
            self.assertEqual(results, [[end] for end in ends], seed)
            delivered = [m[0] for s in servers for m in s.messages.get(1, [])]
            first = []
            seen = set()
            for m in delivered:
                if m not in seen:
                    seen.add(m)
                    first.append(m)
            self.assertEqual(first, [b"%d" % i for i in range(n)], seed)
            self.assertEqual(p.connector.relinks, len(servers) - 1)


class _Reconnector:
    """Records what the connector reports about each connection."""

    def __init__(self):
        self.reports = []

    def progress(self):
        self.reports.append("progress")

    def lost(self, failure, failed):
        self.reports.append("failed" if failed else "worked")


class BackOff(SynchronousTestCase):
    """
    A connection that linked counts as working (reconnect at once) unless
    messages waited and none was acknowledged consumed on it: a listener
    whose store fails discards the link at each append, and resending at
    once would spin.
    """

    def pair(self, **kw):
        p = Pair(**kw)
        p.connector._reconnector = _Reconnector()
        return p

    def test_idle_connection_worked(self):
        p = self.pair().connect()
        p.cut()
        self.assertEqual(p.connector._reconnector.reports, ["progress", "worked"])

    def test_acknowledged_messages_worked(self):
        p = self.pair(server=Recorder(hold=True)).connect()
        p.link.channel(1).send([b"x"], ack=None)
        p.link.channel(1).send([b"y"], ack=None)
        p.run()
        p.server.release(1)
        p.run()
        p.cut()
        self.assertEqual(p.connector._reconnector.reports, ["progress", "worked"])

    def test_nothing_acknowledged_is_a_failure(self):
        p = self.pair(server=Recorder(hold=True)).connect()
        p.link.channel(1).send([b"x"], ack=None)
        p.run()
        p.cut()
        self.assertEqual(p.connector._reconnector.reports, ["failed"])
        # and on a new listener that fails the same way
        p.fail_over(Recorder(hold=True))
        p.connect()
        p.cut()
        self.assertEqual(p.connector._reconnector.reports, ["failed", "failed"])


class SameEpoch(SynchronousTestCase):
    def test_listeners_started_in_the_same_microsecond(self):
        """
        Two listener instances with the same epoch hand out link ids from
        different random starts: a connector moving from one to the other
        (where other connectors hold links already) gets a new link there,
        never another connector's.
        """
        from streamproto.relink.api import ListenerFactory, RelinkEndpoint
        from streamproto.relink.codec import ConnectorHandshake

        def listener(handler, others):
            endpoint = RelinkEndpoint("test", handler, connector_id_size=2,
                                      listener_id_size=2, clock=p.clock)
            for _ in range(others):   # other connectors' links (with ids from 1,
                # the second listener would hold ours as another's)
                endpoint.accept(ConnectorHandshake("test", 2, 2), object())
            return endpoint, ListenerFactory([endpoint], clock=p.clock)
        p = Pair()
        p.endpoint, p.factory = listener(p.server, 3)
        p.connect()
        first = p.link.link_id
        d = fired(p.link.channel(1).send([b"x"]))
        p.cut()
        p.server = Recorder()
        p.endpoint, p.factory = listener(p.server, 4)
        p.connect()
        self.assertNotEqual(p.link.link_id, first)
        self.assertEqual(p.connector.relinks, 1)
        self.assertEqual(d, [1])
        self.assertEqual(p.server.messages, {1: [(b"x",)]})
