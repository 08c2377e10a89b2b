"""
L{streamproto.core.interfaces}: every server protocol with a graceful
shutdown, and every store C{/ready} asks, declares (and really provides)
its interface.
"""

import tempfile

from twisted.internet.task import Clock
from twisted.trial import unittest
from zope.interface.verify import verifyObject

from streamproto.core.interfaces import IGracefulShutdown, IReadiness
from streamproto.core.ops import metrics_site, store_problems
from streamproto.log import LogConfig, MemoryLogStore, open_store


class GracefulShutdownTests(unittest.SynchronousTestCase):
    """Each server protocol that drains on shutdown provides L{IGracefulShutdown}."""

    def setUp(self):
        self.clock = Clock()
        self.store = MemoryLogStore(self.clock)
        self.log = self.successResultOf(self.store.create("log", LogConfig()))

    def assertProvides(self, protocol):
        self.assertTrue(IGracefulShutdown.providedBy(protocol))
        self.assertTrue(verifyObject(IGracefulShutdown, protocol))

    def test_lumberjack(self):
        from streamproto.lumberjack.server import LumberjackServerFactory
        factory = LumberjackServerFactory(object(), clock=self.clock)
        self.assertProvides(factory.buildProtocol(None))

    def test_pravega(self):
        from streamproto.pravega.server import PravegaServerFactory
        factory = PravegaServerFactory(self.store, clock=self.clock)
        self.assertProvides(factory.buildProtocol(None))

    def test_reliable(self):
        from streamproto.reliable.server import ReliableStreamFactory
        from streamproto.reliable.session import MemorySessionStore
        factory = ReliableStreamFactory(MemorySessionStore(self.clock), clock=self.clock)
        self.assertProvides(factory.buildProtocol(None))

    def test_relink_listener(self):
        from streamproto.relink.protocol import ConnectorProtocol, ListenerProtocol
        self.assertProvides(ListenerProtocol(None, self.clock))
        # the client side is not drained by a server's shutdown
        self.assertFalse(IGracefulShutdown.providedBy(ConnectorProtocol(None, self.clock)))

    def test_styx0_streams(self):
        from streamproto.styx.stream import ConsumerStream, ProducerStream
        self.assertProvides(ProducerStream(self.log, clock=self.clock))
        self.assertProvides(ConsumerStream(self.log, 0, clock=self.clock))

    def test_styx_websockets(self):
        from streamproto.styx.websocket import ConsumeProtocol, ProduceProtocol
        from twisted.internet.task import Clock

        from streamproto.log import MemoryLogStore
        clock = Clock()
        log = self.successResultOf(MemoryLogStore(clock).create("events"))
        self.assertProvides(ProduceProtocol(log, clock))
        self.assertProvides(ConsumeProtocol(log, 0, -1, False, clock))


class ReadinessTests(unittest.SynchronousTestCase):
    """What C{/ready} asks provides L{IReadiness}."""

    def test_log_stores(self):
        """Every L{ILogStore} is an L{IReadiness}."""
        from streamproto.log.public import PublicLogStore
        memory = MemoryLogStore(Clock())
        on_disk = open_store(tempfile.mkdtemp())
        self.addCleanup(on_disk.close)
        for store in (memory, on_disk, PublicLogStore(memory)):
            self.assertTrue(verifyObject(IReadiness, store))

    def test_session_store_health(self):
        from streamproto.reliable.session import MemorySessionStore
        from streamproto.reliable.tap import SessionStoreHealth
        health = SessionStoreHealth(MemorySessionStore(Clock()))
        self.assertTrue(verifyObject(IReadiness, health))
        self.assertEqual(store_problems([health]), [])

    def test_jetstream_session_store(self):
        """A JetStream bucket has problems of its own, which C{/ready} reports."""
        from streamproto.reliable.natsessions import JetStreamSessionStore
        from streamproto.reliable.tap import SessionStoreHealth
        sessions = JetStreamSessionStore(["nats://127.0.0.1:4222"], clock=Clock())
        self.assertTrue(verifyObject(IReadiness, sessions))
        sessions.problems = lambda: ["session store bucket: disconnected"]
        self.assertEqual(store_problems([SessionStoreHealth(sessions)]),
                         ["session store bucket: disconnected"])

    def test_undeclared_session_problems_not_asked(self):
        """A session store is asked for its problems through the interface,
        not because it has a method of that name."""
        from streamproto.reliable.tap import SessionStoreHealth

        class Sessions:
            closed = False          # what every ISessionStore says
            failure = None

            def problems(self):
                raise AssertionError("asked without declaring IReadiness")
        self.assertEqual(store_problems([SessionStoreHealth(Sessions())]), [])

    def test_metrics_site_wants_readiness(self):
        """A store that cannot say whether it is ready is refused at start-up."""
        self.assertRaises(TypeError, metrics_site, [object()])
        metrics_site([MemoryLogStore(Clock())])


class StartingStoreTests(unittest.SynchronousTestCase):
    """
    L{streamproto.log.interfaces.IStartingStore}: the stores that connect
    before they serve say so, and the services that own a store start it
    because it says so, not because it has a method named C{start}.
    """

    def test_jetstream_stores(self):
        from streamproto.log.interfaces import IStartingStore
        from streamproto.log.jetstream import JetStreamLogStore
        from streamproto.reliable.natsessions import JetStreamSessionStore
        for store in (JetStreamLogStore(["nats://127.0.0.1:4222"], clock=Clock()),
                      JetStreamSessionStore(["nats://127.0.0.1:4222"], clock=Clock())):
            self.assertTrue(verifyObject(IStartingStore, store))

    def test_local_stores(self):
        from streamproto.log.interfaces import IStartingStore
        from streamproto.reliable.session import MemorySessionStore
        on_disk = open_store(tempfile.mkdtemp())
        self.addCleanup(on_disk.close)
        for store in (MemoryLogStore(Clock()), on_disk, MemorySessionStore(Clock())):
            self.assertFalse(IStartingStore.providedBy(store))

    def _stores(self):
        """A store that declares L{IStartingStore}, and one that only has the method."""
        from twisted.internet.defer import succeed
        from zope.interface import implementer

        from streamproto.log.interfaces import IStartingStore

        started = []

        class Plain:
            def start(self):
                raise AssertionError("started without declaring IStartingStore")

            def close(self):
                return succeed(None)

        @implementer(IStartingStore)
        class Starting(Plain):
            def start(self):
                started.append(self)
                return succeed(None)
        return Plain(), Starting(), started

    def test_session_store_service(self):
        from streamproto.reliable.tap import SessionStoreService
        plain, starting, started = self._stores()
        for store in (plain, starting):
            service = SessionStoreService(store)
            service.startService()
            self.successResultOf(service.stopService())
        self.assertEqual(started, [starting])

    def test_log_store_service(self):
        from streamproto.core.stores import StoreService
        plain, starting, started = self._stores()
        for store in (plain, starting):
            service = StoreService(tempfile.mkdtemp())
            service.store.close()
            service.store = store
            service.startService()
            self.successResultOf(service.stopService())
        self.assertEqual(started, [starting])


class LogDirectoriesTests(unittest.SynchronousTestCase):
    """
    L{streamproto.log.interfaces.ILogDirectories}: what styx backups ask of
    a store, declared by the file store (and its public view) only.
    """

    def test_file_store(self):
        from streamproto.log.interfaces import ILogDirectories
        from streamproto.log.public import PublicLogStore
        store = open_store(tempfile.mkdtemp())
        self.addCleanup(store.close)
        for provider in (store, PublicLogStore(store)):
            self.assertTrue(verifyObject(ILogDirectories, provider))
            self.assertEqual(provider.log_path("events"), f"{store.path}/events")

    def test_memory_store(self):
        from streamproto.log.interfaces import ILogDirectories
        from streamproto.log.public import PublicLogStore
        store = MemoryLogStore(Clock())
        self.assertFalse(ILogDirectories.providedBy(store))
        self.assertFalse(ILogDirectories.providedBy(PublicLogStore(store)))

    def test_backup_asks_the_interface(self):
        """A store with a C{path} but without the interface has no backups."""
        from streamproto.styx.backup import store_directory
        from streamproto.styx.errors import APIError

        class NotFiles:
            path = "/somewhere"
        self.assertRaises(APIError, store_directory, NotFiles())
        store = open_store(tempfile.mkdtemp())
        self.addCleanup(store.close)
        self.assertEqual(store_directory(store), store.path)
