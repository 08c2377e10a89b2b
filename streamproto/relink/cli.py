"""
C{streamproto relink}: a small Relink client.

    streamproto relink send [-s HOST:PORT] [--endpoint log] [--channel N]
                            [--transactions] [--commit-every K] < lines
    streamproto relink echo [-s HOST:PORT] [-n N] [--size B]

C{send} sends every stdin line (without its newline) as one message and
exits once all are consumed (or committed); C{echo} round-trips messages
through the server's C{echo} endpoint and prints the rate.  The common
options (C{-s/--server}, TLS, C{-f}, C{-v}/C{-q}, C{-n}, C{-t}) are those
of every streamproto command: L{streamproto.core.cli}, doc/cli.rst.  Once
everything is sent, a command waits at most C{--shutdown-timeout} seconds
for the server's shutdown, then exits with an error saying so.
"""

import argparse
import sys
import time

from twisted.internet import defer
from twisted.internet.interfaces import IStreamClientEndpoint
from zope.interface import implementer

from streamproto.core import cli as common
from streamproto.core.stall import give_up_when_stalled
from streamproto.relink.api import ChannelHandler, Connector
from streamproto.relink.codec import CONSUMED
from streamproto.relink.config import LinkConfig
from streamproto.relink.errors import CommitOutcomeUnknown

PROG = "streamproto relink"
CONVENTION = common.Convention(
    PROG, "127.0.0.1:7350", timeout=10.0,
    timeout_help="seconds to wait for the link (the server refuses a handshake for an "
                 "unknown endpoint, other id sizes, or a missing client certificate by "
                 "closing: the connector would retry for ever)",
    renamed={"--link-timeout": "-t/--timeout"})


class CLIError(common.CommandError):
    """An error reported as C{streamproto relink: error: ...} with exit status 1."""


@implementer(IStreamClientEndpoint)
class _FirstAttempt:
    """
    An endpoint reporting whether its first connection attempt failed.

    The connector reconnects for ever, which suits a service but leaves a
    command waiting silently on a wrong address: the CLI gives up instead.
    """

    def __init__(self, endpoint):
        self._endpoint = endpoint
        self.failed = defer.Deferred()
        self._first = True

    def connect(self, protocol_factory):
        d = self._endpoint.connect(protocol_factory)
        if self._first:
            self._first = False

            def failed(f):
                self.failed.errback(f)
                return f
            d.addErrback(failed)
        return d


class _Counter(ChannelHandler):
    def __init__(self):
        self.count = 0
        self.waiter = None
        self.want = 0

    def messages_received(self, link, channel_id, messages):
        self.count += len(messages)
        if self.waiter is not None and self.count >= self.want:
            d, self.waiter = self.waiter, None
            d.callback(self.count)


def _parser():
    p = CONVENTION.parser(
        "A small Relink client: send stdin lines as messages, or echo messages through "
        "the server's echo endpoint and print the rate.")
    p.add_argument("--id-size", type=int, default=4, help="channel id size (server's --id-size)")
    # the previous release's name of -t/--timeout
    p.add_argument("--link-timeout", dest="timeout", type=common.seconds,
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds to wait for an acknowledgement (while sending, and for the "
                        "last ones once everything is sent) and for the server's shutdown: "
                        "a server that stopped answering would keep the command waiting for "
                        "ever; default 10")
    p.add_argument("--window", type=int, default=LinkConfig.window,
                   help="messages in flight per channel before waiting for acknowledgements "
                        f"(the send window); default {LinkConfig.window}, the Go package "
                        "keeps 65536")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("send", help="send stdin lines as messages",
                       parents=[CONVENTION.common()])
    s.add_argument("--endpoint", default="log")
    s.add_argument("--channel", type=int, default=0)
    s.add_argument("--transactions", action="store_true",
                   help="use connector transactions (the server's log-tx endpoint)")
    s.add_argument("--commit-every", type=int, default=1000)
    e = sub.add_parser("echo", help="round-trip messages through the echo endpoint",
                       parents=[CONVENTION.common()])
    e.add_argument("-n", "--count", type=int, default=10000, help="messages; default 10000")
    e.add_argument("--size", type=int, default=64, help="bytes a message; default 64")
    return p


def _connector(reactor, args, endpoint, handler, transactions=False):
    first = _FirstAttempt(CONVENTION.endpoint(reactor, args))
    config = LinkConfig(window=args.window, max_queued=args.window,
                        shutdown_timeout=args.shutdown_timeout)
    c = Connector(first, endpoint, handler, connector_id_size=args.id_size,
                  listener_id_size=args.id_size, connector_transactions=transactions,
                  config=config, clock=reactor)
    c.start()
    return c, first.failed


@defer.inlineCallbacks
def _linked(reactor, c, failed, args):
    """
    The connector's link; CLIError if the first connection attempt failed,
    or if no link came within C{-t/--timeout}.
    """
    linked = c.when_linked()
    either = defer.Deferred()
    linked.addBoth(lambda r: either.called or either.callback(r))
    failed.addErrback(lambda f: either.called or either.errback(f))
    timer = None
    if args.timeout:
        timer = reactor.callLater(args.timeout, lambda: either.called or either.errback(
            TimeoutError(f"no link after {args.timeout:g}s (the server closes a handshake "
                         "for an unknown endpoint or other id sizes, and TLS without the "
                         "client certificate it requires)")))
    try:
        link = yield either
    except Exception as e:
        yield c.stop()
        raise CLIError(f"cannot connect to {args.server.address}: {common.error_text(e)}")
    finally:
        if timer is not None and timer.active():
            timer.cancel()
    return link


def _acknowledged(reactor, args, ch, d, sent):
    """
    C{d} (a wait for the server's acknowledgements on channel C{ch}), given
    up with a L{Stalled} line after C{--shutdown-timeout} seconds without
    any: the connector waits for ever on a server that stopped answering
    (paused, or its store never answering) while the link stays up.
    """
    def message():
        return (f"no acknowledgement from {args.server.address} for "
                f"{args.shutdown_timeout:g} s (--shutdown-timeout); giving up with "
                f"{ch.consumed} of {sent} messages acknowledged")
    return give_up_when_stalled(reactor, d, args.shutdown_timeout, message,
                                lambda: ch.consumed)


def _commit(ch):
    """
    C{ch.commit()}: True, False, or None when its outcome is unknown (the
    link moved to a new listener while the old one had it unanswered: it
    was not sent again, so it is stored once or not at all).
    """
    return ch.commit().addErrback(lambda f: f.trap(CommitOutcomeUnknown) and None)


@defer.inlineCallbacks
def _send(reactor, args, lines, out):
    c, failed = _connector(reactor, args, args.endpoint, ChannelHandler(), args.transactions)
    link = yield _linked(reactor, c, failed, args)
    ch = link.channel(args.channel)
    sent = 0
    pending = []
    last = None
    for line in lines:
        while ch.room <= 0:
            yield _acknowledged(reactor, args, ch, ch.when_writable(), sent)
        last = ch.send_payloads([line.rstrip(b"\n")])
        sent += 1
        if args.transactions and sent % args.commit_every == 0:
            pending.append(_commit(ch))
    if args.transactions and (sent % args.commit_every or not pending):
        pending.append(_commit(ch))
    if last is not None:
        yield _acknowledged(reactor, args, ch, last, sent)
    results = yield _acknowledged(reactor, args, ch, defer.gatherResults(pending),
                                  sent)
    yield c.shutdown(timeout=args.shutdown_timeout)
    failed = results.count(False)
    unknown = results.count(None)
    # the connector moved to a listener that did not know its link (another
    # front-end of -s a,b, a restarted server): said, with what it resent
    moved = (f"; link re-established {c.relinks} time(s) on a new listener, {c.resent} "
             "messages resent (at least once)") if c.relinks else ""
    common.emit(args, out, f"sent {sent} messages"
                + (f", {failed} commits failed" if failed else "")
                + (f", {unknown} commits of unknown outcome (the server went away before "
                   "answering: each stored once or not at all)" if unknown else "") + moved,
                {"sent": sent, "commits_failed": failed, "commits_unknown": unknown,
                 "relinks": c.relinks, "resent": c.resent})
    return common.EXIT_FAILURE if failed or unknown else common.EXIT_OK


@defer.inlineCallbacks
def _echo(reactor, args, out):
    counter = _Counter()
    c, failed = _connector(reactor, args, "echo", counter)
    link = yield _linked(reactor, c, failed, args)
    ch = link.channel(1)
    payload = b"e" * args.size
    counter.want = args.count
    counter.waiter = defer.Deferred()
    start = time.perf_counter()
    sent = 0
    consumed = None
    while sent < args.count:
        room = min(ch.room, args.count - sent)
        if room <= 0:
            yield _acknowledged(reactor, args, ch, ch.when_writable(), sent)
            continue
        sent += room
        # acks are cumulative: the last batch's CONSUMED covers every message
        consumed = ch.send_payloads([payload] * room,
                                    ack=CONSUMED if sent == args.count else None)
    yield _acknowledged(reactor, args, ch, counter.waiter, sent)
    elapsed = time.perf_counter() - start
    # a listener may stop acknowledging once it has our shutdown (the Go one
    # does): shut down only when everything sent is acknowledged
    yield _acknowledged(reactor, args, ch, consumed, sent)
    yield c.shutdown(timeout=args.shutdown_timeout)
    common.emit(args, out, f"{args.count} messages of {args.size} B echoed in {elapsed:.3f}s: "
                f"{args.count / elapsed:,.0f} msg/s",
                {"messages": args.count, "size": args.size, "seconds": elapsed,
                 "messages_per_second": args.count / elapsed})
    return common.EXIT_OK


def run(reactor, args, stdin, stdout, stderr):
    """
    Run the parsed command: a Deferred firing with the exit status (errors
    are written to C{stderr} as C{streamproto relink: error: ...}, status 1).

    @param stdin: binary lines for C{send}; @param stdout: text output.
    """
    stop = CONVENTION.log_to(args, stderr)
    if args.command == "send":
        d = defer.maybeDeferred(_send, reactor, args, stdin, stdout)
    else:
        d = defer.maybeDeferred(_echo, reactor, args, stdout)
    d.addErrback(CONVENTION.report, stderr)
    return d.addBoth(lambda r: (stop(), r)[1])


def parse_args(argv, stderr=None):
    """The parsed arguments (raises SystemExit(2) with a usage message if bad)."""
    parser = _parser()
    args = CONVENTION.parse(parser, argv, stderr)
    if args.command == "send" and args.commit_every < 1:
        parser.error("--commit-every must be at least 1")
    if not args.shutdown_timeout > 0:
        parser.error("--shutdown-timeout must be positive")
    if args.window < 1:
        parser.error("--window must be at least 1")
    if args.command == "echo" and (args.count < 1 or args.size < 0):
        parser.error("--count must be at least 1 and --size at least 0")
    return args


def main(argv):
    try:
        args = parse_args(argv)
    except SystemExit as e:
        return e.code
    return CONVENTION.run(lambda reactor: run(reactor, args, sys.stdin.buffer, sys.stdout,
                                              sys.stderr))
