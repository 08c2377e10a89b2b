"""
The Relink connection states driven directly: no protocol, no transport,
a L{Clock} and an effects recorder standing for the connection.
"""

from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import implementer
from zope.interface.verify import verifyObject

from streamproto.relink import codec
from streamproto.relink.api import Connector, ListenerFactory, RelinkEndpoint, Relinked
from streamproto.relink.config import LinkConfig
from streamproto.relink.connection_state import ConnectorState, IConnectionEffects, ListenerState
from streamproto.relink.protocol import ConnectorProtocol, ListenerProtocol
from test.relink.test_relink_support import Recorder

TIMEOUT = LinkConfig().handshake_timeout
SIZES = (2, 2)


@implementer(IConnectionEffects)
class Effects:
    """
    Records what a connection state does to its connection.

    @ivar calls: the effects in order, as tuples (name, args...); what was
        written is in C{written}, not here.
    """

    def __init__(self, principals=("anonymous",)):
        self.calls = []
        self.written = []
        self._principals = principals

    def names(self):
        return [c[0] for c in self.calls]

    def take(self):
        """@return: the bytes written so far, forgotten."""
        data, self.written = b"".join(self.written), []
        return data

    def write(self, data):
        self.written.append(data)

    def write_sequence(self, chunks):
        self.written.extend(chunks)

    def lose_connection(self):
        self.calls.append(("lose_connection",))

    def abort_connection(self):
        self.calls.append(("abort_connection",))

    def register_producer(self):
        self.calls.append(("register_producer",))

    def unregister_producer(self):
        self.calls.append(("unregister_producer",))

    def pause_reading(self):
        self.calls.append(("pause_reading",))

    def resume_reading(self):
        self.calls.append(("resume_reading",))

    def peer(self):
        return "peer"

    def principals(self):
        return self._principals


def handshake(name="test", epoch=0, link_id=0, require_old_link=False, sizes=SIZES):
    """The connector's version block and handshake."""
    return codec.encode_version() + codec.encode_connector_handshake(
        codec.ConnectorHandshake(name, sizes[0], sizes[1], require_old_link=require_old_link,
                                 epoch=epoch, link_id=link_id))


class EffectsTests(SynchronousTestCase):
    def test_interface(self):
        """The protocols of both roles, and the recorder, provide the effects."""
        clock = Clock()
        verifyObject(IConnectionEffects, Effects())
        verifyObject(IConnectionEffects, ListenerProtocol(None, clock))
        verifyObject(IConnectionEffects, ConnectorProtocol(None, clock))


class ListenerStateTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.handler = Recorder()
        self.endpoint = RelinkEndpoint("test", self.handler, connector_id_size=SIZES[0],
                                       listener_id_size=SIZES[1], clock=self.clock,
                                       first_link_id=1)
        self.factory = ListenerFactory([self.endpoint], clock=self.clock)

    def connect(self, data=None):
        effects = Effects()
        state = ListenerState(self.factory, effects, self.clock)
        state.connection_made()
        if data is not None:
            state.data_received(data)
        return state, effects

    def test_handshake_accepted(self):
        """
        A handshake for a known endpoint gets our version and the new link's
        epoch and id; the link is attached to the connection, which becomes
        its transport's producer, and the handshake timeout is off.
        """
        state, effects = self.connect()
        data = handshake()
        for i in range(len(data)):             # whatever the pieces
            state.data_received(data[i:i + 1])
        link = state.link
        self.assertEqual(list(self.endpoint.links.values()), [link])
        self.assertEqual(effects.take(), codec.encode_version()
                         + codec.encode_listener_reply(self.endpoint.epoch, link.link_id))
        self.assertEqual(effects.names(), ["register_producer"])
        self.assertTrue(link.attached)
        self.assertIs(link.owner, effects)
        self.assertEqual(self.handler.attached, [False])
        self.clock.advance(TIMEOUT)
        self.assertNotIn("abort_connection", effects.names())

    def test_packets_after_handshake_reach_the_link(self):
        """Bytes following the handshake in the same read are the link's."""
        packet = codec.encode_message((1,), [b"hello"], SIZES[0])
        state, effects = self.connect(handshake() + packet)
        self.assertEqual(self.handler.messages, {1: [(b"hello",)]})
        state.data_received(packet)
        self.assertEqual(self.handler.messages, {1: [(b"hello",), (b"hello",)]})

    def test_unknown_endpoint_refused(self):
        """
        A handshake for an endpoint we do not serve closes the connection
        before any link exists; later bytes are ignored.
        """
        state, effects = self.connect(handshake("nope"))
        self.assertEqual(effects.take(), codec.encode_version())
        self.assertEqual(effects.names(), ["lose_connection"])
        state.data_received(bytes(64))
        self.assertEqual((effects.names(), effects.written), (["lose_connection"], []))
        self.assertIsNone(state.link)
        self.assertEqual(self.endpoint.links, {})

    def test_mismatched_sizes_refused(self):
        state, effects = self.connect(handshake(sizes=(4, 4)))
        self.assertEqual(effects.names(), ["lose_connection"])
        self.assertEqual(self.endpoint.links, {})

    def test_forbidden_refused(self):
        """An authorizer that denies the connection's principals refuses the handshake."""
        class Deny:
            enabled = True

            def allows(self, principals, op, resource):
                self.asked = (principals, op, resource)
                return False
        self.factory.authorizer = deny = Deny()
        state, effects = self.connect(handshake())
        self.assertEqual(deny.asked, (("anonymous",), "write", "relink:test"))
        self.assertEqual(effects.names(), ["lose_connection"])
        self.assertEqual(self.endpoint.links, {})

    def test_handshake_timeout(self):
        """An incomplete handshake is aborted when the timeout expires, not before."""
        state, effects = self.connect(handshake()[:12])
        self.clock.advance(TIMEOUT - 0.1)
        self.assertEqual(effects.names(), [])
        self.clock.advance(0.1)
        self.assertEqual(effects.names(), ["abort_connection"])
        self.assertIsNone(state.link)
        # the connection goes; nothing more is done
        state.connection_lost()
        self.assertEqual(effects.names(), ["abort_connection"])

    def test_refused_connection_aborted_at_timeout(self):
        """
        A refused connection that does not close (its peer reads nothing, so
        the close waits) is aborted when the handshake timeout expires.
        """
        state, effects = self.connect(handshake("nope"))
        self.clock.advance(TIMEOUT)
        self.assertEqual(effects.names(), ["lose_connection", "abort_connection"])

    def test_lost_before_handshake_stops_the_timeout(self):
        state, effects = self.connect(codec.encode_version())
        state.connection_lost()
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertEqual(effects.names(), [])

    def test_resume(self):
        """
        A handshake naming the link of a connection that was lost resumes
        it: same link, same id, attached to the new connection.
        """
        first, effects1 = self.connect(handshake())
        link = first.link
        first.connection_lost()
        self.assertFalse(link.attached)
        second, effects2 = self.connect(handshake(epoch=link.epoch, link_id=link.link_id))
        self.assertIs(second.link, link)
        self.assertTrue(link.attached)
        self.assertIs(link.owner, effects2)
        self.assertEqual(effects2.take()[8:24],
                         codec.encode_listener_reply(link.epoch, link.link_id))
        self.assertEqual(self.handler.attached, [False, True])
        self.assertEqual(list(self.endpoint.links), [link.link_id])

    def test_resume_replaces_a_connection_not_yet_lost(self):
        """
        The connector comes back before the old connection is noticed dead:
        the old one is aborted, and its loss no longer detaches the link.
        """
        first, effects1 = self.connect(handshake())
        link = first.link
        second, effects2 = self.connect(handshake(epoch=link.epoch, link_id=link.link_id))
        self.assertEqual(effects1.names(), ["register_producer", "abort_connection"])
        first.connection_lost()
        self.assertTrue(link.attached)
        self.assertIs(link.owner, effects2)

    def test_new_link(self):
        """A handshake without a link id, or with an unknown one, starts a new link."""
        first, _ = self.connect(handshake())
        first.connection_lost()
        second, _ = self.connect(handshake())
        third, _ = self.connect(handshake(epoch=self.endpoint.epoch, link_id=99))
        ids = [s.link.link_id for s in (first, second, third)]
        self.assertEqual(ids, [1, 2, 3])
        self.assertEqual(self.handler.attached, [False, False, False])

    def test_required_link_gone(self):
        """
        A connector requiring a link we do not know any more gets link id
        zero and is disconnected.
        """
        state, effects = self.connect(handshake(epoch=self.endpoint.epoch, link_id=7,
                                                require_old_link=True))
        self.assertEqual(effects.take(), codec.encode_version()
                         + codec.encode_listener_reply(self.endpoint.epoch, 0))
        self.assertEqual(effects.names(), ["lose_connection"])
        self.assertIsNone(state.link)
        self.assertEqual(self.endpoint.links, {})

    def test_lost_while_linked(self):
        """
        The connection is lost: the link is detached but kept for a
        resumption (until the endpoint's link timeout).
        """
        state, effects = self.connect(handshake())
        link = state.link
        state.connection_lost()
        self.assertFalse(link.attached)
        self.assertIsNone(link.owner)
        self.assertIsNone(link.lost)
        self.assertEqual(list(self.endpoint.links.values()), [link])
        state.data_received(bytes(16))        # a read racing the loss is ignored
        self.assertEqual(effects.names(), ["register_producer"])
        self.clock.advance(self.endpoint.config.link_timeout)
        self.assertEqual(self.endpoint.links, {})

    def test_protocol_error_discards_the_link(self):
        """A malformed packet discards the link and closes the connection."""
        state, effects = self.connect(handshake())
        link = state.link
        state.data_received(b"\xff" * 16)
        self.assertIsNotNone(link.lost)
        # the discarded link closes its connection, and so does the state
        self.assertEqual(effects.names(), ["register_producer", "lose_connection",
                                           "lose_connection"])
        self.assertEqual(self.endpoint.links, {})

    def test_transmission_paused_by_the_transport(self):
        state, effects = self.connect(handshake())
        state.pause_transmission(True)
        self.assertTrue(state.link.transmission_paused)
        state.pause_transmission(False)
        self.assertFalse(state.link.transmission_paused)

    def test_graceful_shutdown(self):
        """
        A graceful stop reads no more, waits for the handler to finish what
        it has, writes its acknowledgements and closes; what arrives
        meanwhile is ignored, the link kept for the connector's return.
        """
        self.handler.hold = True
        state, effects = self.connect(handshake() + codec.encode_message((1,), [b"m"], SIZES[0]))
        effects.take()
        link = state.link
        done = []
        state.graceful_shutdown().addCallback(done.append)
        self.assertEqual(effects.names(), ["register_producer", "pause_reading"])
        self.assertEqual(done, [])
        self.handler.release()
        self.assertEqual(done, [None])
        self.assertEqual(effects.names(), ["register_producer", "pause_reading",
                                           "resume_reading", "lose_connection"])
        self.assertNotEqual(effects.take(), b"")   # the acknowledgements
        state.data_received(codec.encode_message((1,), [b"late"], SIZES[0]))
        self.assertEqual(self.handler.messages, {1: [(b"m",)]})
        state.connection_lost()
        self.assertIsNone(link.lost)
        self.assertFalse(link.attached)

    def test_graceful_shutdown_keeps_reading_paused(self):
        """
        The handler catching up during a graceful stop ends the backpressure
        pause, but reading resumes only to close.
        """
        self.endpoint.config = LinkConfig(max_unconsumed=1)
        self.handler.hold = True
        message = codec.encode_message((1,), [b"m"], SIZES[0])
        state, effects = self.connect(handshake() + message + message)
        self.assertEqual(effects.names(), ["register_producer", "pause_reading"])
        state.graceful_shutdown()
        self.handler.release()
        self.assertEqual(effects.names(), ["register_producer", "pause_reading",
                                           "pause_reading", "resume_reading",
                                           "lose_connection"])

    def test_graceful_shutdown_before_handshake(self):
        """Without a link there is nothing to finish: the connection closes at once."""
        state, effects = self.connect(codec.encode_version())
        done = []
        state.graceful_shutdown().addCallback(done.append)
        self.assertEqual((done, effects.names()), ([None], ["lose_connection"]))


class ConnectorStateTests(SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.handler = Recorder()
        self.connector = Connector(None, "test", self.handler, connector_id_size=SIZES[0],
                                   listener_id_size=SIZES[1], clock=self.clock)
        self.epoch = 1234

    def connect(self):
        effects = Effects()
        state = ConnectorState(self.connector, effects, self.clock)
        state.connection_made()
        return state, effects

    def test_speaks_first(self):
        """The connector sends its version, then its handshake after the listener's."""
        state, effects = self.connect()
        self.assertEqual(effects.take(), codec.encode_version())
        state.data_received(codec.encode_version())
        self.assertEqual(effects.take(), codec.encode_connector_handshake(
            codec.ConnectorHandshake("test", SIZES[0], SIZES[1])))

    def test_handshake_accepted(self):
        state, effects = self.connect()
        state.data_received(codec.encode_version()
                            + codec.encode_listener_reply(self.epoch, 5))
        link = self.connector.link
        self.assertIs(state.link, link)
        self.assertEqual((link.epoch, link.link_id), (self.epoch, 5))
        self.assertTrue(link.attached)
        self.assertIs(link.owner, effects)
        self.assertIs(self.connector.protocol, effects)
        self.assertEqual(effects.names(), ["register_producer"])
        linked = []
        self.connector.when_linked().addCallback(linked.append)
        self.assertEqual(linked, [link])
        self.clock.advance(TIMEOUT)
        self.assertNotIn("abort_connection", effects.names())

    def test_unsupported_version_refused(self):
        state, effects = self.connect()
        effects.take()
        state.data_received(codec.encode_version(1))
        self.assertEqual((effects.written, effects.names()), ([], ["lose_connection"]))

    def test_handshake_timeout(self):
        state, effects = self.connect()
        state.data_received(codec.encode_version())
        self.clock.advance(TIMEOUT)
        self.assertEqual(effects.names(), ["abort_connection"])
        self.assertFalse(self.connector.link.attached)

    def test_resume(self):
        """The same epoch and link id again: the link is resumed, not replaced."""
        first, effects1 = self.connect()
        first.data_received(codec.encode_version() + codec.encode_listener_reply(self.epoch, 5))
        link = first.link
        first.connection_lost()
        self.assertFalse(link.attached)
        self.assertIsNone(self.connector.protocol)
        second, effects2 = self.connect()
        second.data_received(codec.encode_version())
        self.assertEqual(effects2.take(), codec.encode_version() + codec.encode_connector_handshake(
            codec.ConnectorHandshake("test", SIZES[0], SIZES[1], epoch=self.epoch, link_id=5)))
        second.data_received(codec.encode_listener_reply(self.epoch, 5))
        self.assertIs(self.connector.link, link)
        self.assertIs(link.owner, effects2)
        self.assertIsNone(link.lost)
        self.assertEqual(self.handler.attached, [False, True])
        # a resumed link sends its resume first
        self.assertIn(codec.encode_general(codec.RESUME), effects2.take())

    def test_new_link(self):
        """
        Another link id from the listener, without failover: the old link
        is discarded, a new one starts.
        """
        self.connector.failover = False
        first, _ = self.connect()
        first.data_received(codec.encode_version() + codec.encode_listener_reply(self.epoch, 5))
        old = first.link
        first.connection_lost()
        second, _ = self.connect()
        second.data_received(codec.encode_version() + codec.encode_listener_reply(self.epoch, 6))
        self.assertIsNot(second.link, old)
        self.assertIs(self.connector.link, second.link)
        self.assertEqual(second.link.link_id, 6)
        self.assertIsNotNone(old.lost)
        self.assertEqual(self.handler.attached, [False, False])

    def test_new_link_relinks(self):
        """
        Another link id from the listener (by default): the same link goes
        on under the new id, and says so.
        """
        first, _ = self.connect()
        first.data_received(codec.encode_version() + codec.encode_listener_reply(self.epoch, 5))
        old = first.link
        old.channel(1).send([b"x"], ack=None)
        first.connection_lost()
        relinked = []
        self.connector.when_relinked().addCallback(relinked.append)
        second, effects2 = self.connect()
        second.data_received(codec.encode_version()
                             + codec.encode_listener_reply(self.epoch + 1, 6))
        self.clock.advance(0)
        self.assertIs(second.link, old)
        self.assertIsNone(old.lost)
        self.assertEqual((old.epoch, old.link_id), (self.epoch + 1, 6))
        self.assertEqual(self.handler.attached, [False, False])
        self.assertEqual(relinked, [Relinked(self.epoch, 5, self.epoch + 1, 6, 1, 1)])
        self.assertEqual(self.connector.relinks, 1)
        # the message goes again, with no resume first: the new listener
        # never saw the link
        sent = effects2.take()
        self.assertNotIn(codec.encode_general(codec.RESUME), sent)
        self.assertIn(b"x", sent)

    def test_listener_lost_the_link(self):
        """Link id zero: the listener lost our link; the connection is closed."""
        first, _ = self.connect()
        first.data_received(codec.encode_version() + codec.encode_listener_reply(self.epoch, 5))
        old = first.link
        first.connection_lost()
        second, effects = self.connect()
        second.data_received(codec.encode_version() + codec.encode_listener_reply(self.epoch, 0))
        self.assertEqual(effects.names(), ["lose_connection"])
        self.assertIsNone(second.link)
        self.assertIsNotNone(old.lost)
        self.assertIsNot(self.connector.link, old)

    def test_lost_while_linked(self):
        state, effects = self.connect()
        state.data_received(codec.encode_version() + codec.encode_listener_reply(self.epoch, 5))
        link = state.link
        state.connection_lost()
        self.assertFalse(link.attached)
        self.assertIsNone(link.lost)
        self.assertIsNone(self.connector.protocol)
        self.assertIs(self.connector.link, link)
