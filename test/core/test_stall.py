"""
Every client command gives up on a stalled server within the timeout it
states, with one line saying so (L{streamproto.core.stall}).

A stalled server keeps the connection up and answers nothing: a paused
process (SIGSTOP: the kernel still accepts and buffers; here a listener
whose protocol never writes) or a server whose store never answers
(L{HeldStore}: the Relink link comes up, acknowledgements never do, the
shape of a relink-server whose nats-server is paused).  Before the stall
watch, C{styx produce}/C{consume}, C{pravega write}/C{info}, C{reliable
client} and C{relink send} waited for ever (relink past its
C{--shutdown-timeout}); C{lumberjack send} gave up already.
"""

import os
import sys

from twisted.internet import defer, protocol, reactor, task
from twisted.trial import unittest

from streamproto.core.stall import Answers, Stalled, give_up_when_stalled
from test.support.torture_harness import ROOT

#: the command's timeout in these tests, and the slack allowed on top
TIMEOUT = 1.5
SLACK = 2.5
#: a process's start-up (imports) on the shared machine
STARTUP = 6.0


class GiveUpWhenStalledTests(unittest.SynchronousTestCase):
    def test_stalled(self):
        clock = task.Clock()
        cancelled = []
        waiting = defer.Deferred(cancelled.append)
        d = give_up_when_stalled(clock, waiting, 4, lambda: "stuck")
        clock.pump([1] * 3)
        self.assertNoResult(d)
        clock.pump([1] * 2)
        self.assertEqual(str(self.failureResultOf(d, Stalled).value), "stuck")
        # the wait was cancelled, its late outcome (CancelledError) ignored
        self.assertEqual(cancelled, [waiting])
        self.assertFalse(clock.getDelayedCalls())

    def test_progress_keeps_it_waiting(self):
        clock = task.Clock()
        waiting = defer.Deferred()
        answers = Answers(clock)
        d = give_up_when_stalled(clock, waiting, 4, lambda: "stuck", answers.progress)
        for _ in range(20):
            clock.advance(1)
            answers.add()
        self.assertNoResult(d)
        waiting.callback("done")
        self.assertEqual(self.successResultOf(d), "done")

    def test_waiting_elsewhere_is_progress(self):
        clock = task.Clock()
        answers = Answers(clock)
        d = give_up_when_stalled(clock, defer.Deferred(), 2, lambda: "stuck", answers.progress)
        answers.elsewhere += 1
        clock.pump([1] * 10)
        self.assertNoResult(d)
        answers.elsewhere -= 1
        clock.pump([1] * 3)
        self.failureResultOf(d, Stalled)

    def test_failure_passes_through(self):
        clock = task.Clock()
        waiting = defer.Deferred()
        d = give_up_when_stalled(clock, waiting, 4, lambda: "stuck")
        waiting.errback(ValueError("no"))
        self.failureResultOf(d, ValueError)
        self.assertFalse(clock.getDelayedCalls())

    def test_zero_waits_for_ever(self):
        waiting = defer.Deferred()
        self.assertIs(give_up_when_stalled(task.Clock(), waiting, 0, lambda: "x"), waiting)


class _Command(protocol.ProcessProtocol):
    def __init__(self, stdin):
        self.stdin = stdin
        self.err = []
        self.ended = defer.Deferred()

    def connectionMade(self):
        self.transport.write(self.stdin)
        self.transport.closeStdin()

    def errReceived(self, data):
        self.err.append(data)

    def processEnded(self, reason):
        self.ended.callback((reason.value.exitCode, b"".join(self.err).decode()))


def run_command(argv, stdin=b""):
    """
    C{python -m streamproto ARGV} as a process of its own (as the report
    ran it; it exits, leaving nothing behind): fires with (status, stderr,
    seconds).
    """
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = _Command(stdin)
    process = reactor.spawnProcess(command, sys.executable,
                                   [sys.executable, "-m", "streamproto"] + argv, env=env,
                                   path=ROOT)
    started = reactor.seconds()
    # a command that hangs is killed (the test then fails saying so)
    killer = reactor.callLater(TIMEOUT + SLACK + STARTUP + 10, process.signalProcess, "KILL")

    def ended(result):
        if killer.active():
            killer.cancel()
        return result + (reactor.seconds() - started,)
    return command.ended.addCallback(ended)


class _Silent(protocol.Protocol):
    def connectionMade(self):
        self.factory.connections.append(self.transport)


def _silent_server(test):
    """A listener that accepts and never answers: a paused server process."""
    factory = protocol.Factory.forProtocol(_Silent)
    factory.connections = []
    port = reactor.listenTCP(0, factory, interface="127.0.0.1")
    test.addCleanup(lambda: [t.abortConnection() for t in factory.connections])
    test.addCleanup(port.stopListening)
    return f"127.0.0.1:{port.getHost().port}"


class StalledServerTests(unittest.TestCase):
    timeout = 60

    @defer.inlineCallbacks
    def gives_up(self, argv, stdin=b""):
        """C{streamproto ARGV} exits with 1 within the timeout; its stderr."""
        status, err, elapsed = yield run_command(argv, stdin)
        self.assertIsNotNone(status, f"still waiting after {elapsed:.0f} s: killed")
        self.assertEqual(status, 1, err)
        # the interpreter's start-up is on top of the timeout
        self.assertLess(elapsed, TIMEOUT + SLACK + STARTUP, err)
        return err

    @defer.inlineCallbacks
    def test_styx_produce(self):
        server = _silent_server(self)
        text = yield self.gives_up(["styx", "-s", server, "-t", str(TIMEOUT), "produce", "log"],
                                   b"a\nb\n")
        self.assertIn(f"error: no answer from {server} for {TIMEOUT:g} s (-t/--timeout); "
                      "giving up (0 records acknowledged)", text)

    @defer.inlineCallbacks
    def test_styx_consume(self):
        server = _silent_server(self)
        text = yield self.gives_up(["styx", "-s", server, "-t", str(TIMEOUT), "consume", "log"])
        self.assertIn(f"no answer from {server} for {TIMEOUT:g} s (-t/--timeout); giving up "
                      "(0 records read)", text)

    @defer.inlineCallbacks
    def test_pravega_write(self):
        server = _silent_server(self)
        text = yield self.gives_up(["pravega", "-s", server, "-t", str(TIMEOUT), "write",
                                    "s/t/0.#epoch.0"], b"one\ntwo\n")
        self.assertIn(f"error: no answer from {server} for {TIMEOUT:g} s "
                      "(-t/--timeout); giving up (0 events acknowledged)", text)

    @defer.inlineCallbacks
    def test_pravega_info(self):
        server = _silent_server(self)
        text = yield self.gives_up(["pravega", "-s", server, "-t", str(TIMEOUT), "info",
                                    "s/t/0.#epoch.0"])
        self.assertIn(f"error: no answer from {server} for {TIMEOUT:g} s", text)

    @defer.inlineCallbacks
    def test_reliable_client(self):
        server = _silent_server(self)
        text = yield self.gives_up(["reliable", "client", "-s", server, "-t", str(TIMEOUT),
                                    "-n", "5"])
        self.assertIn(f"the server said nothing for {TIMEOUT:g} s", text)

    @defer.inlineCallbacks
    def test_lumberjack_send(self):
        server = _silent_server(self)
        text = yield self.gives_up(["lumberjack", "send", "-s", server, "-t", str(TIMEOUT), "-"],
                                   b'{"a": 1}\n')
        self.assertIn(f"nothing acknowledged by {server} in {TIMEOUT:g} s", text)

    def relink_server(self):
        """A relink-server whose store never answers (a paused nats-server)."""
        from streamproto.relink.api import ListenerFactory
        from streamproto.relink.config import LinkConfig
        from streamproto.relink.endpoints import server_endpoints
        from test.support.heldstore import HeldStore
        store = HeldStore()
        config = LinkConfig(link_timeout=1)
        factory = ListenerFactory(server_endpoints(store, config=config, clock=reactor),
                                  config=config, clock=reactor)
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return f"127.0.0.1:{port.getHost().port}", store

    @defer.inlineCallbacks
    def relink_send(self, extra):
        server, store = self.relink_server()
        text = yield self.gives_up(["relink", "-s", server, "--shutdown-timeout", str(TIMEOUT),
                                    "send"] + extra, b"one\ntwo\n")
        self.assertTrue(store.pending(), "the store was never asked")
        store.fail_all(ConnectionError("the test is over"))
        self.flushLoggedErrors()
        return text

    @defer.inlineCallbacks
    def test_relink_send_log(self):
        text = yield self.relink_send(["--endpoint", "log"])
        self.assertIn("error: no acknowledgement from 127.0.0.1:", text)
        self.assertIn(f"for {TIMEOUT:g} s (--shutdown-timeout); giving up with 0 of 2 "
                      "messages acknowledged", text)

    @defer.inlineCallbacks
    def test_relink_send_log_tx(self):
        text = yield self.relink_send(["--endpoint", "log-tx", "--transactions"])
        self.assertIn(f"for {TIMEOUT:g} s (--shutdown-timeout); giving up", text)
