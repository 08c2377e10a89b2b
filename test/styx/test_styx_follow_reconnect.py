"""
C{streamproto styx consume -F} keeps following across a server that shuts
down (Error(SHUTDOWN) on styx/0, the long poll ended over HTTP) and comes
back on the same port and data: it reconnects with backoff and resumes at
the next record, so its output is every record once, in order.
"""

import io
import tempfile

from twisted.internet import defer, reactor, task
from twisted.trial import unittest

from streamproto.styx import cli
from streamproto.styx import tap as styx_tap
from streamproto.styx.api_client import StyxClient
from test.support.netutil import wait_until
from test.support.test_ops_support import RunningService


def records(start, n):
    return [b"record-%06d" % i for i in range(start, start + n)]


class FollowerReconnectTests(unittest.TestCase):
    timeout = 120

    @defer.inlineCallbacks
    def start_server(self, data, port=0):
        server = RunningService(styx_tap, data=data, port=port, shutdown_timeout=5.0)
        yield server.start(self)
        return server

    @defer.inlineCallbacks
    def write(self, port, batch):
        client = StyxClient(f"http://127.0.0.1:{port}", reactor)
        try:
            yield client.write_records("events", batch)
        finally:
            yield client.close()

    @defer.inlineCallbacks
    def follow_across_a_restart(self, *mode):
        data = tempfile.mkdtemp() + "/data"
        server = yield self.start_server(data)
        port = server.port
        client = StyxClient(f"http://127.0.0.1:{port}", reactor)
        self.addCleanup(client.close)
        yield client.create_log("events")
        yield self.write(port, records(0, 100))

        args = cli.parse_args(["-s", f"127.0.0.1:{port}", "consume", "events", "-F",
                               "-n", "300", "-t", "60", *mode])
        out = io.BytesIO()
        following = defer.ensureDeferred(cli.consume(reactor, args, client, stdout=out,
                                                     err=io.StringIO()))
        yield wait_until(lambda: out.getvalue().count(b"\n") == 100, timeout=30)

        yield server.stop()             # graceful: the follower is told SHUTDOWN
        # the follower retries against a closed port for a while: it must not give up
        yield task.deferLater(reactor, 1.0, lambda: None)
        self.assertFalse(following.called, following)

        server = yield self.start_server(data, port)
        yield self.write(port, records(100, 150))
        yield wait_until(lambda: out.getvalue().count(b"\n") >= 250, timeout=30)
        yield self.write(port, records(250, 60))    # 10 more than it asked for
        status = yield following
        self.assertEqual(status, 0)
        got = out.getvalue().splitlines()
        if got != records(0, 300):
            seen = set()
            dups = [r for r in got if r in seen or seen.add(r)]
            self.fail(f"{len(got)} records, {len(dups)} duplicated ({dups[:3]}), "
                      f"missing {sorted(set(records(0, 300)) - set(got))[:3]}")

    def test_styx0_follower(self):
        return self.follow_across_a_restart()

    def test_http_follower(self):
        return self.follow_across_a_restart("--http")

    @defer.inlineCallbacks
    def test_gives_up_after_the_timeout(self):
        data = tempfile.mkdtemp() + "/data"
        server = yield self.start_server(data)
        client = StyxClient(f"http://127.0.0.1:{server.port}", reactor)
        self.addCleanup(client.close)
        yield client.create_log("events")
        args = cli.parse_args(["-s", f"127.0.0.1:{server.port}", "consume", "events", "-F",
                               "-t", "1"])
        out = io.BytesIO()
        following = defer.ensureDeferred(cli.consume(reactor, args, client, stdout=out,
                                                     err=io.StringIO()))
        yield task.deferLater(reactor, 0.5, lambda: None)
        yield server.stop()
        error = yield self.assertFailure(following, cli.CLIError)
        self.assertIn("the server has been away for", str(error))
        self.assertIn("-t/--timeout 1", str(error))

    @defer.inlineCallbacks
    def test_unknown_log_is_not_retried(self):
        data = tempfile.mkdtemp() + "/data"
        server = yield self.start_server(data)
        client = StyxClient(f"http://127.0.0.1:{server.port}", reactor)
        self.addCleanup(client.close)
        args = cli.parse_args(["-s", f"127.0.0.1:{server.port}", "consume", "nope", "-F"])
        from streamproto.styx.api_client import StyxAPIError
        yield self.assertFailure(defer.ensureDeferred(
            cli.consume(reactor, args, client, stdout=io.BytesIO(), err=io.StringIO())),
            StyxAPIError)


class RetriableTests(unittest.SynchronousTestCase):
    def test_retriable(self):
        from twisted.internet.error import ConnectionRefusedError

        from streamproto.styx.codec import ErrorCode
        from streamproto.styx.stream_client import StyxStreamError
        self.assertTrue(cli._retriable(StyxStreamError(ErrorCode.SHUTDOWN)))
        self.assertTrue(cli._retriable(ConnectionRefusedError()))
        self.assertFalse(cli._retriable(StyxStreamError(ErrorCode.UNKNOWN_MESSAGE_TYPE)))
        self.assertFalse(cli._retriable(ValueError("bad")))
