"""The client's stream bookkeeping, without a network."""

from twisted.trial.unittest import SynchronousTestCase

from streamproto.reliable import codec
from streamproto.reliable.client import StatefulClient, _StatefulSession, _StatelessSession
from streamproto.reliable.errors import CRCMismatch, ProtocolError
from test.reliable.test_reliable_codec import VECTORS


def stateful(message_id, value, crc=None):
    return codec.StatefulMessage(message_id, value, crc)


class StatefulSessionTests(SynchronousTestCase):
    def test_spec_example(self):
        session = _StatefulSession(5, "u", ack_every=2)
        self.assertEqual(session.initial_message(), codec.encode_open("u", 5))
        values = VECTORS["spec_example"]["values"]
        replies = []
        for i, value in enumerate(values[:4], 1):
            more, finished = session.receive(stateful(i, value))
            self.assertFalse(finished)
            replies += more
        self.assertEqual(replies, [codec.encode_ack("u", 2), codec.encode_ack("u", 4)])
        self.assertEqual(session.initial_message(), codec.encode_resume("u", 4))
        _, finished = session.receive(stateful(5, values[4], VECTORS["spec_example"]["crc"]))
        self.assertTrue(finished)
        result = session.result(0)
        self.assertEqual((result.values, result.crc), (values, VECTORS["spec_example"]["crc"]))

    def test_wrong_crc(self):
        session = _StatefulSession(2, "u", 16)
        session.receive(stateful(1, 10))
        self.assertRaises(CRCMismatch, session.receive, stateful(2, 11, 12345))

    def test_gaps_duplicates_and_extra_messages(self):
        session = _StatefulSession(3, "u", 16)
        session.receive(stateful(1, 10))
        self.assertRaises(ProtocolError, session.receive, stateful(1, 10))
        self.assertRaises(ProtocolError, session.receive, stateful(3, 10))
        session.receive(stateful(2, 10))
        self.assertRaises(ProtocolError, session.receive, stateful(3, 10))  # no crc on the last
        short = _StatefulSession(3, "u", 16)
        self.assertRaises(ProtocolError, short.receive, stateful(1, 10, 0))  # crc too early
        self.assertRaises(ProtocolError, short.receive, codec.StatelessValue("1"))

    def test_arguments(self):
        self.assertRaises(ValueError, StatefulClient, None, 0)
        self.assertRaises(ValueError, StatefulClient, None, 0x10000)
        self.assertRaises(ValueError, StatefulClient, None, 5, retry_delay=1)


class StatelessSessionTests(SynchronousTestCase):
    def test_resume_with_last_value(self):
        session = _StatelessSession(3)
        self.assertEqual(session.initial_message(), b"{}\n")
        self.assertEqual(session.receive(codec.StatelessValue("23")), ([], False))
        self.assertEqual(session.initial_message(), codec.encode_stateless_resume("23"))
        session.receive(codec.StatelessValue("46"))
        self.assertEqual(session.receive(codec.StatelessValue("92")), ([], True))
        self.assertEqual(session.result(0).values, ["23", "46", "92"])

    def test_keep_only_the_last(self):
        session = _StatelessSession(2, keep=False)
        session.receive(codec.StatelessValue("23"))
        self.assertEqual(session.initial_message(), codec.encode_stateless_resume("23"))
        self.assertEqual(session.receive(codec.StatelessValue("46")), ([], True))
        self.assertEqual(session.result(0).values, ["46"])
