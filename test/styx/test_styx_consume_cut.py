"""
L{RecordStreamer} when a read fails after the response began: what was
queued goes out, then the connection closes without the last chunk; a
client that stopped reading is cut off after C{CUT_TIMEOUT}.
"""

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from streamproto.log.errors import CorruptLog
from streamproto.styx import consume, formats


class FakeTransport:
    def __init__(self):
        self.calls = []

    def loseConnection(self):
        self.calls.append("lose")

    def abortConnection(self):
        self.calls.append("abort")


class FakeChannel:
    def __init__(self):
        self.transport = FakeTransport()


class FakeRequest:
    """What L{RecordStreamer._fail} uses of a twisted.web request whose
    status line and first records are already written."""

    startedWriting = True
    _disconnected = False

    def __init__(self):
        self.channel = FakeChannel()
        self.finished = []

    def unregisterProducer(self):
        pass

    def notifyFinish(self):
        d = Deferred()
        self.finished.append(d)
        return d

    def lose(self):
        self._disconnected = True
        for d in self.finished:
            d.errback(ConnectionError("lost"))


class FakeSender:
    """A direct sender holding bytes the client has not read."""

    def __init__(self):
        self.closed = False
        self.drained = Deferred()

    def unregisterProducer(self):
        pass

    def when_drained(self):
        return self.drained

    def close(self):
        self.closed = True


class CutTests(SynchronousTestCase):

    def streamer(self, sender):
        request = FakeRequest()
        streamer = consume.RecordStreamer(request, log_named("events"), 0, -1, False, None,
                                          formats.encode_binary)
        streamer._reactor = self.clock = Clock()
        streamer._sender = sender
        streamer._fail(Failure(CorruptLog("checksum mismatch")))
        self.flushLoggedErrors(CorruptLog)
        return request

    def test_queued_bytes_go_out_first(self):
        sender = FakeSender()
        request = self.streamer(sender)
        calls = request.channel.transport.calls
        self.assertEqual(calls, [])            # still sending what was queued
        self.assertFalse(sender.closed)
        sender.drained.callback(None)
        self.assertTrue(sender.closed)
        self.assertEqual(calls, ["lose"])       # no last chunk: the client sees a cut body
        request.lose()
        self.clock.advance(consume.CUT_TIMEOUT)
        self.assertEqual(calls, ["lose"])
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_a_client_that_stopped_reading_is_cut_off(self):
        sender = FakeSender()
        request = self.streamer(sender)
        calls = request.channel.transport.calls
        self.clock.advance(consume.CUT_TIMEOUT - 0.1)
        self.assertEqual(calls, [])
        self.clock.advance(0.1)
        # the sender's duplicate descriptor closed too, or the socket would stay open
        self.assertTrue(sender.closed)
        self.assertEqual(calls, ["abort"])

    def test_without_a_direct_sender(self):
        request = self.streamer(None)
        self.assertEqual(request.channel.transport.calls, ["lose"])
        request.lose()
        self.assertEqual(self.clock.getDelayedCalls(), [])


def log_named(name):
    class Log:
        pass
    log = Log()
    log.name = name
    return log
