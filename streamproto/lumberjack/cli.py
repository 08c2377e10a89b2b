"""
C{streamproto lumberjack send}: send JSON lines (one event a line) from a
file or stdin to a Lumberjack server, with a progress line on a terminal.

    streamproto lumberjack send --host logs.example --port 5044 events.jsonl
    tail -F app.log.json | streamproto lumberjack send --tls --ca ca.pem \\
        --cert client.pem --key client.key --host logs.example -
"""

import sys

from twisted.internet import defer, task
from twisted.logger import LogLevel, formatEvent, globalLogPublisher
from twisted.python import usage

from streamproto.core.progress import Progress
from streamproto.core.tls import client_endpoint, client_tls_options
from streamproto.lumberjack.client import LumberjackClient
from streamproto.lumberjack.codec import ProtocolError, validate_json


class SendOptions(usage.Options):
    synopsis = "[options] [FILE]   (FILE of JSON lines; '-' or none: stdin)"
    optFlags = [["tls", None, "Connect with TLS (verifying the server)."]]
    optParameters = [
        ["host", "H", "127.0.0.1", "Server host."],
        ["port", "p", 5044, "Server port.", int],
        ["ca", None, None, "PEM file of CAs to verify the server with (default: system)."],
        ["cert", None, None, "Client certificate (PEM)."],
        ["key", None, None, "Client private key (PEM)."],
        ["server-name", None, None, "Name to verify in the server certificate (default: host)."],
        ["batch", "b", 2048, "Largest batch (bulk_max_size).", int],
        ["compression", "z", 3, "zlib level, 0 for none.", int],
        ["pipelining", None, 2, "Batches in flight.", int],
        ["timeout", None, 30.0, "Seconds to wait for an ack.", float],
        ["give-up", None, 60.0, "Seconds without any acknowledged event (a refused port, a "
         "TLS setting the server refuses) before the command gives up with an error; "
         "0: retry for ever.", float],
    ]

    def parseArgs(self, path="-"):
        self["file"] = path

    def postOptions(self):
        if not 0 <= self["compression"] <= 9:
            raise usage.UsageError("--compression must be 0..9")
        if self["batch"] < 1 or self["pipelining"] < 1:
            raise usage.UsageError("--batch and --pipelining must be positive")
        if (self["cert"] or self["key"] or self["ca"]) and not self["tls"]:
            self["tls"] = True
        if self["give-up"] < 0:
            raise usage.UsageError("--give-up must not be negative")


class Options(usage.Options):
    synopsis = "streamproto lumberjack"
    subCommands = [["send", None, SendOptions, "Send JSON lines as events."]]

    def postOptions(self):
        if self.subCommand is None:
            raise usage.UsageError("missing command (send)")


def read_events(stream, chunk, errors):
    """Lists of up to C{chunk} valid JSON lines (bytes); bad lines go to C{errors}."""
    events = []
    for number, line in enumerate(stream, 1):
        line = line.strip()
        if not line:
            continue
        try:
            validate_json(line)
        except ProtocolError:
            errors.write(f"line {number}: not a JSON document, skipped\n")
            errors.skipped += 1
            continue
        events.append(line)
        if len(events) >= chunk:
            yield events
            events = []
    if events:
        yield events


class GaveUp(Exception):
    """Nothing was acknowledged for C{--give-up} seconds."""


def _client_warnings(stream, client, last=None):
    """
    A log observer writing C{client}'s warnings (cannot connect, TLS
    refused, no ack) to C{stream}: the client retries for ever, and without
    them a wrong address or TLS setting would look like a silent hang.  The
    last one is kept in C{last["warning"]} (for the give-up message).
    """
    def observer(event):
        if (event.get("log_source") is client
                and event.get("log_level", LogLevel.info) >= LogLevel.warn):
            text = formatEvent(event)
            if last is not None:
                last["warning"] = text.removeprefix("lumberjack client: ").removesuffix(
                    "; reconnecting")
            stream.write(f"streamproto lumberjack: {text}\n")
    return observer


class _Errors:
    def __init__(self, stream):
        self.stream = stream
        self.skipped = 0

    def write(self, text):
        self.stream.write(text)


@defer.inlineCallbacks
def send(reactor, options, stream, out=None, err=None):
    """Send every line of C{stream}; returns (sent, skipped)."""
    out = out or sys.stdout
    err = _Errors(err or sys.stderr)
    tls = None
    if options["tls"]:
        tls = client_tls_options(options["server-name"] or options["host"], options["ca"],
                                 options["cert"], options["key"])
    endpoint = client_endpoint(reactor, options["host"], options["port"], tls)
    client = LumberjackClient(endpoint, clock=reactor, bulk_max_size=options["batch"],
                              compression_level=options["compression"],
                              pipelining=options["pipelining"], timeout=options["timeout"])
    progress = Progress("lumberjack send", stream=err.stream)
    counts = {"acked": 0, "bytes": 0}
    in_flight = []
    # keep a few batches' worth queued ahead, not the whole file
    chunk = options["batch"]
    ahead = max(2, options["pipelining"]) * 2

    def acked(n, nbytes):
        counts["acked"] += n
        counts["bytes"] += nbytes
        progress.update(counts["acked"], counts["bytes"])
        return n

    last = {"warning": None}
    warnings = _client_warnings(err.stream, client, last)
    globalLogPublisher.addObserver(warnings)
    gave_up = []
    watchdog = None
    if options["give-up"]:
        progress_seen = {"acked": -1, "at": reactor.seconds()}

        def watch():
            # the client retries for ever (a service would); a command gives up
            if client.events_acked != progress_seen["acked"] or not client.pending:
                progress_seen.update(acked=client.events_acked, at=reactor.seconds())
            elif reactor.seconds() - progress_seen["at"] >= options["give-up"]:
                gave_up.append(last["warning"] or "no acknowledgement")
                watchdog.stop()
                client.close()
        watchdog = task.LoopingCall(watch)
        watchdog.clock = reactor
        watchdog.start(min(1.0, options["give-up"] / 4), now=False)
    try:
        for events in read_events(stream, chunk, err):
            nbytes = sum(map(len, events))
            d = client.send(events)
            d.addCallback(acked, nbytes)
            in_flight.append(d)
            if len(in_flight) >= ahead:
                yield in_flight.pop(0)
        for d in in_flight:
            yield d
    except Exception:
        if gave_up:
            raise GaveUp(f"nothing acknowledged by {options['host']}:{options['port']} in "
                         f"{options['give-up']:g} s; giving up (last: {gave_up[0]})")
        raise
    finally:
        if watchdog is not None and watchdog.running:
            watchdog.stop()
        globalLogPublisher.removeObserver(warnings)
        yield client.close()
    progress.finish()
    out.write(f"sent {counts['acked']} events")
    out.write(f", skipped {err.skipped} bad lines\n" if err.skipped else "\n")
    return counts["acked"], err.skipped


def main(argv):
    options = Options()
    try:
        options.parseOptions(argv)
    except usage.UsageError as e:
        sys.stderr.write(f"{options}\nstreamproto lumberjack: {e}\n")
        return 2
    sub = options.subOptions
    result = {}

    def run(reactor):
        stream = sys.stdin.buffer if sub["file"] == "-" else open(sub["file"], "rb")
        d = send(reactor, sub, stream)

        def done(r):
            result["value"] = r

        def gave_up(f):
            f.trap(GaveUp)
            sys.stderr.write(f"streamproto lumberjack: {f.value}\n")
            result["value"] = (0, 1)

        def closed(r):
            if stream is not sys.stdin.buffer:
                stream.close()
            return r
        return d.addCallbacks(done, gave_up).addBoth(closed)

    try:
        task.react(run)
    except SystemExit as e:
        if e.code:
            return e.code
    sent, skipped = result.get("value", (0, 1))
    return 1 if skipped else 0
