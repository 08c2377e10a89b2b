"""
Reliable streams against a session store that answers later: a message
goes out only once the store stored it (its id and the session's state
with it), a session starts only once registered, a client's ack or
resume takes effect only once stored; a store that fails ends the
connection, and no message generated after a failed one goes out.
"""

import random

from twisted.trial.unittest import SynchronousTestCase

from streamproto.reliable.errors import StoreUnavailable
from streamproto.reliable.server import ReliableStreamFactory
from streamproto.reliable.session import MemorySessionStore
from test.support.heldstore import HeldCalls
from test.reliable.test_reliable_server import U, Connection, TurnClock


class HeldSessionStore(HeldCalls, MemorySessionStore):
    """A memory session store whose register/put/ack wait for the test."""

    def __init__(self, clock):
        MemorySessionStore.__init__(self, clock, expiry=30)
        self.asked = []
        self.held = {"register", "put", "ack"}

    def register(self, uuid, state):
        return self._ask("register", uuid, (), {},
                         lambda: MemorySessionStore.register(self, uuid, state))

    def put(self, uuid, transformer):
        return self._ask("put", uuid, (), {},
                         lambda: MemorySessionStore.put(self, uuid, transformer))

    def ack(self, uuid, message_id):
        return self._ask("ack", uuid, (message_id,), {},
                         lambda: MemorySessionStore.ack(self, uuid, message_id))


class ReliableAckTests(SynchronousTestCase):
    def setUp(self):
        self.clock = TurnClock()
        self.store = HeldSessionStore(self.clock)
        self.factory = ReliableStreamFactory(self.store, clock=self.clock,
                                             rng=random.Random(7))

    def ids(self, connection):
        return [m["id"] for m in connection.messages() if "id" in m]

    def test_messages_only_once_stored(self):
        c = Connection(self, self.factory).send({"uuid": U, "params": {"count": 3}})
        self.assertEqual([h.operation for h in self.store.pending()], ["register"])
        self.assertEqual(c.messages(), [])
        self.store.release_all("register")
        self.clock.advance(0)
        self.assertTrue(self.store.pending("put"))
        self.assertEqual(c.messages(), [], "a message sent before it was stored")
        self.store.pending("put")[0].release()
        self.clock.advance(0)
        self.assertEqual(self.ids(c), [1])
        for _ in range(10):
            self.store.release_all()
            self.clock.advance(0)
        self.assertEqual(self.ids(c), [2, 3])

    def test_failed_put_ends_the_stream_and_later_ones_stay_unsent(self):
        c = Connection(self, self.factory).send({"uuid": U, "params": {"count": 5}})
        self.store.release_all("register")
        self.clock.advance(0)
        puts = self.store.pending("put")
        self.assertGreaterEqual(len(puts), 2)
        puts[0].fail(StoreUnavailable("session store: nats: timeout"))
        for later in puts[1:]:
            later.release()
        self.clock.advance(0)
        self.clock.advance(1)
        self.assertEqual(self.ids(c), [])
        self.assertTrue(c.closed)

    def test_register_fails(self):
        c = Connection(self, self.factory).send({"uuid": U, "params": {"count": 3}})
        self.store.fail_all(OSError("disk on fire"))
        self.clock.advance(0)
        messages = c.messages()
        self.assertEqual([m for m in messages if "id" in m], [])
        self.assertTrue(c.closed)
        self.flushLoggedErrors(OSError)

    def test_resume_replays_only_after_the_ack_is_stored(self):
        c = Connection(self, self.factory).send({"uuid": U, "params": {"count": 5}})
        for _ in range(3):
            self.store.release_all("register")
            self.store.release_all("put")
            self.clock.advance(0)
        self.assertEqual(self.ids(c)[:2], [1, 2])
        c.close()
        resumed = Connection(self, self.factory).send({"uuid": U, "state": 1})
        self.clock.advance(0)
        self.assertEqual([h.args for h in self.store.pending("ack")], [(1,)])
        self.assertEqual(resumed.messages(), [], "replayed before the resume's ack was stored")
        self.store.fail_all(StoreUnavailable("session store: nats: timeout"), "ack")
        self.clock.advance(1)
        self.assertEqual(self.ids(resumed), [])
        self.assertTrue(resumed.closed)
