"""The in-memory network of the protocol tests (L{test.support.memnet})."""

from twisted.internet.error import ConnectionAborted, ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer

from test.support.memnet import CLIENT, SERVER, Connection, RecordingProducer


class Recording(Protocol):
    """Keeps what it reads and why its connection ended."""

    def __init__(self):
        self.data = []
        self.lost = []

    def dataReceived(self, data):
        self.data.append(data)

    def connectionLost(self, reason):
        self.lost.append(reason)


@implementer(IHalfCloseableProtocol)
class HalfCloseable(Recording):
    read_closed = False

    def readConnectionLost(self):
        self.read_closed = True

    def writeConnectionLost(self):
        pass


class ConnectionTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.server, self.client = Recording(), Recording()
        self.conn = Connection(self.server, self.client, self.clock)

    def test_connected_server_first(self):
        order = []

        class Noting(Recording):
            def connectionMade(self):
                order.append(self)
        server, client = Noting(), Noting()
        Connection(server, client)
        self.assertEqual(order, [server, client])
        self.assertIs(server.transport.getHost(), client.transport.getPeer())

    def test_pieces(self):
        self.client.transport.write(b"abcdefg")
        self.server.transport.write(b"xy")
        self.assertTrue(self.conn.step(3))
        self.assertEqual((self.server.data, self.client.data), ([b"abc"], [b"xy"]))
        self.conn.step(lambda: 10)
        self.assertEqual(self.server.data, [b"abc", b"defg"])
        self.assertEqual(self.conn.delivered, {SERVER: 7, CLIENT: 2})
        self.assertFalse(self.conn.step())

    def test_a_paused_reader_gets_nothing(self):
        self.server.transport.pauseProducing()
        self.client.transport.write(b"waits")
        self.assertFalse(self.conn.step())
        self.assertEqual(self.server.data, [])
        self.server.transport.resumeProducing()
        self.conn.step()
        self.assertEqual(self.server.data, [b"waits"])
        # unless told otherwise
        self.conn.honour_pauses = False
        self.server.transport.pauseProducing()
        self.client.transport.write(b"anyway")
        self.conn.step()
        self.assertEqual(self.server.data, [b"waits", b"anyway"])

    def test_flow_control(self):
        conn = Connection(Recording(), Recording(), server_limit=4)
        producer = RecordingProducer()
        transport = conn.server_transport
        transport.registerProducer(producer, True)
        transport.write(b"1234")
        self.assertEqual(producer.events, [])
        transport.write(b"5")
        transport.write(b"6")
        self.assertEqual(producer.events, ["pause"])
        self.assertEqual(transport.take(2), b"12")
        self.assertEqual(producer.events, ["pause"])
        conn.step()
        self.assertEqual(producer.events, ["pause", "resume"])
        self.assertEqual(transport.largest, 6)

    def test_producer_rules(self):
        transport = self.conn.server_transport
        transport.registerProducer(RecordingProducer(), True)
        self.assertRaises(RuntimeError, transport.registerProducer, RecordingProducer(), True)
        transport.unregisterProducer()
        self.assertRaises(RuntimeError, transport.unregisterProducer)
        transport.loseConnection()
        self.assertRaises(RuntimeError, transport.pauseProducing)

    def test_close_once_written_data_arrived(self):
        self.server.transport.write(b"bye")
        self.server.transport.loseConnection()
        self.server.transport.write(b" now")      # still sent, as TCP sends it
        self.client.transport.write(b"never read")
        self.conn.step(2)
        self.assertTrue(self.conn.up)
        self.conn.step()
        self.assertFalse(self.conn.up)
        self.assertEqual(b"".join(self.client.data), b"bye now")
        self.assertEqual(self.server.data, [])      # a closing transport stops reading
        for protocol in (self.server, self.client):
            self.assertEqual(len(protocol.lost), 1)
            protocol.lost[0].trap(ConnectionDone)
        self.assertFalse(self.client.transport.connected)

    def test_cut_with_prefixes(self):
        self.client.transport.write(b"0123456789")
        self.server.transport.write(b"abc")
        self.conn.cut(to_server=4, to_client=lambda data: len(data) - 1)
        self.assertEqual((self.server.data, self.client.data), ([b"0123"], [b"ab"]))
        self.server.lost[0].trap(ConnectionLost)
        self.client.transport.write(b"lost")
        self.assertFalse(self.conn.step())

    def test_half_open(self):
        self.conn.cut(tell=[CLIENT])
        self.assertEqual((len(self.server.lost), len(self.client.lost)), (0, 1))
        self.conn.notify(SERVER)
        self.conn.notify(SERVER)
        self.assertEqual(len(self.server.lost), 1)

    def test_abort_is_reported_on_the_next_turn(self):
        self.server.transport.write(b"in flight")
        self.client.transport.abortConnection()
        self.assertFalse(self.conn.step())
        self.assertEqual((self.server.lost, self.client.lost), ([], []))
        self.clock.advance(0)
        self.client.lost[0].trap(ConnectionAborted)
        self.server.lost[0].trap(ConnectionLost)
        self.assertEqual(self.client.data, [])

    def test_half_close(self):
        self.server.transport.write(b"last")
        self.server.transport.loseWriteConnection()
        self.server.transport.write(b"dropped")
        self.conn.step()
        # a peer that cannot half-close sees the end of the connection
        self.assertEqual(self.client.data, [b"last"])
        self.client.lost[0].trap(ConnectionDone)
        self.assertEqual(len(self.server.lost), 1)
        # one that can reads the end of the stream and may still write
        server, client = Recording(), HalfCloseable()
        conn = Connection(server, client)
        server.transport.loseWriteConnection()
        conn.step()
        self.assertTrue(client.read_closed)
        self.assertTrue(conn.up)
        client.transport.write(b"answer")
        client.transport.loseConnection()
        conn.step()
        self.assertEqual(server.data, [b"answer"])
        self.assertFalse(conn.up)

    def test_flush(self):
        self.client.transport.write(b"ping")
        self.conn.flush()
        self.assertEqual(self.server.data, [b"ping"])
