"""
C{streamproto reliable client}: fetch a stream and verify it.

    streamproto reliable client --count 1000 --port 7341
    streamproto reliable client --mode stateless --count 20 --print
    streamproto reliable client --tls --ca-certs ca.pem --cert c.pem --key k.pem
"""

import sys

from twisted.internet import task
from twisted.python import usage

from streamproto.core.errors import describe
from streamproto.core.tls import client_endpoint, client_tls_options
from streamproto.reliable.client import (
    DEFAULT_ACK_EVERY,
    DEFAULT_GIVE_UP_AFTER,
    DEFAULT_RETRY_DELAY,
    StatefulClient,
    StatelessClient,
)


class ClientOptions(usage.Options):
    synopsis = "streamproto reliable client [options]"
    optParameters = [
        ["host", "H", "127.0.0.1", "Server host."],
        ["port", "p", 7341, "Server port.", int],
        ["count", "n", 100, "Messages to receive (stateful: 1..65535).", int],
        ["mode", "m", "stateful", "stateful or stateless."],
        ["uuid", None, None, "Session UUID (stateful; default: random)."],
        ["ack-every", None, DEFAULT_ACK_EVERY, "Ack every Nth message id (0: never).", int],
        ["retry-delay", None, DEFAULT_RETRY_DELAY, "Seconds to wait after a failed connect "
         "(at least 5).", float],
        ["backoff", None, 1.0, "Multiply the retry delay by this after each failure.", float],
        ["give-up-after", None, DEFAULT_GIVE_UP_AFTER, "Seconds without a connection before "
         "giving up.", float],
        ["ca-certs", None, None, "PEM CA bundle to verify the server (implies --tls)."],
        ["cert", None, None, "PEM client certificate (implies --tls)."],
        ["key", None, None, "PEM client private key (default: --cert)."],
        ["server-name", None, None, "Name to verify in the server certificate "
         "(default: --host)."],
    ]
    optFlags = [
        ["tls", None, "Connect with TLS."],
        ["print", None, "Print every value received."],
    ]

    def postOptions(self):
        if self["mode"] not in ("stateful", "stateless"):
            raise usage.UsageError("--mode is stateful or stateless")
        if self["mode"] == "stateful" and not 1 <= self["count"] <= 0xFFFF:
            raise usage.UsageError("--count must be in 1..65535 in stateful mode")
        if self["count"] < 1:
            raise usage.UsageError("--count must be positive")
        if self["retry-delay"] < DEFAULT_RETRY_DELAY:
            raise usage.UsageError("--retry-delay must be at least 5 seconds")
        if self["ca-certs"] or self["cert"]:
            self["tls"] = True


def _run(reactor, options, out):
    tls = None
    if options["tls"]:
        tls = client_tls_options(options["server-name"] or options["host"],
                                 ca_certs=options["ca-certs"], cert=options["cert"],
                                 private_key=options["key"])
    endpoint = client_endpoint(reactor, options["host"], options["port"], tls)
    common = dict(clock=reactor, retry_delay=options["retry-delay"], backoff=options["backoff"],
                  give_up_after=options["give-up-after"])
    if options["mode"] == "stateful":
        client = StatefulClient(endpoint, options["count"], uuid=options["uuid"],
                                ack_every=options["ack-every"], **common)
    else:
        # values double: keep them all only to print them
        client = StatelessClient(endpoint, options["count"], keep=options["print"], **common)

    def report(result):
        if options["print"]:
            for value in result.values:
                out.write(f"{value}\n")
        line = f"received {options['count']} messages, {result.reconnects} reconnects"
        if result.crc is not None:
            line += f", CRC {result.crc} verified (uuid {result.uuid})"
        out.write(line + "\n")
        return 0

    def failed(failure):
        # a protocol failure (ReliableError) or a connection-level one
        why = describe(failure)
        sys.stderr.write(f"streamproto reliable client: {why}\n")
        return 1

    return client.run().addCallbacks(report, failed)


def main(argv, out=None):
    out = out or sys.stdout
    if not argv or argv[0] != "client":
        sys.stderr.write("usage: streamproto reliable client [options]  (--help for options)\n")
        return 2
    options = ClientOptions()
    try:
        options.parseOptions(argv[1:])
    except usage.UsageError as e:
        sys.stderr.write(f"{e}\n{options}")
        return 2
    status = []

    def go(reactor):
        d = _run(reactor, options, out)
        d.addCallback(status.append)
        return d

    try:
        task.react(go)
    except SystemExit:
        pass
    return status[0] if status else 1
