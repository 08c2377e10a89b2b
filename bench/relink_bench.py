"""
Relink benchmark: small messages (1 part, 64 B by default) over one link
with consumed acknowledgements, and multi-part messages, next to a baseline.

Two modes (both run by default):

- C{memory}: a connector and a listener joined by an in-process pipe (no
  sockets): the protocol's own CPU cost, from C{send_many} to the handler
  and the consumed acks back.  Baseline: encoding the same messages with
  the codec and slicing them out again with C{struct.unpack_from} (the
  least any implementation of the wire format has to do), as a ratio.
- C{tcp}: the listener in a child process on 127.0.0.1, the connector here.
  Baseline: the same bytes (pre-encoded) pushed through a raw socket to a
  child that reads and discards them.

    python bench/relink_bench.py [--messages N] [--size B] [--parts P]
        [--window W] [--batch K] [--mode memory|tcp|both|echo] [--echo-size B]

C{echo}: the server's own C{echo} endpoint (a child with the server's
defaults) and a connector here keeping 65,536 messages in flight (the Go
package's default window) next to 4,096 (the most a connector could keep
before the server stopped treating more as an error), in the same run.

The machine may be shared: run it a few times and take the best.
"""

import argparse
import os
import socket
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.benchenv import measured  # noqa: E402
measured()   # which streamproto and path this measures (bench/benchenv.py)

from streamproto.relink import codec  # noqa: E402
from streamproto.relink.api import ChannelHandler  # noqa: E402
from streamproto.relink.config import LinkConfig  # noqa: E402
from streamproto.relink.link import Link  # noqa: E402


class Counter(ChannelHandler):
    def __init__(self):
        self.count = 0
        self.parts = 0

    def messages_received(self, link, channel_id, messages):
        self.count += len(messages)
        return None


class ManualClock:
    """Enough IReactorTime for a pipe with no reactor: calls run when pumped."""

    def __init__(self):
        self.calls = []

    def seconds(self):
        return time.monotonic()

    def callLater(self, delay, f, *args):
        call = _Call(f, args, delay)
        if delay == 0:
            self.calls.append(call)
        return call

    def run(self):
        calls, self.calls = self.calls, []
        for c in calls:
            if c.live:
                c.live = False
                c.f(*c.args)
        return bool(calls)


class _Call:
    def __init__(self, f, args, delay):
        self.f, self.args, self.delay, self.live = f, args, delay, True

    def active(self):
        return self.live

    def cancel(self):
        self.live = False


def memory_run(n, size, parts, window, batch):
    clock = ManualClock()
    config = LinkConfig(window=window, max_queued=window, ping_interval=1e9)
    counter = Counter()
    a = Link(ChannelHandler(), clock, role="connector", own_id_size=4, peer_id_size=4,
             config=config, link_id=1, epoch=1)
    b = Link(counter, clock, role="listener", own_id_size=4, peer_id_size=4,
             config=config, link_id=1, epoch=1)
    to_b, to_a = [], []
    a.attach(to_b.extend, lambda: None, False)
    b.attach(to_a.extend, lambda: None, False)
    ch = a.channel(1)
    msg = [b"m" * (size // parts)] * parts
    sent = 0
    start = time.perf_counter()
    while counter.count < n or ch.consumed < n:
        room = min(ch.room, n - sent, batch)
        if room > 0:
            if parts == 1:
                ch.send_payloads([msg[0]] * room, ack=None)
            else:
                ch.send_many([msg] * room, ack=None)
            sent += room
        clock.run()
        if to_b:
            data = b"".join(to_b)
            to_b.clear()
            b.data_received(data)
        clock.run()
        if to_a:
            data = b"".join(to_a)
            to_a.clear()
            a.data_received(data)
    return time.perf_counter() - start


def memory_baseline(n, size, parts, batch):
    """Encode with the codec's fast path, then find every payload with unpack_from."""
    msg = [b"m" * (size // parts)] * parts
    enc = codec.UnicastMessageEncoder(1, 4)
    start = time.perf_counter()
    done = 0
    u16 = struct.Struct("<H").unpack_from
    while done < n:
        k = min(batch, n - done)
        out = []
        enc.encode([msg[0]] * k if parts == 1 else [tuple(msg)] * k, out)
        data = b"".join(out)
        mv = memoryview(data)
        off = 0
        end = len(data)
        got = []
        while off < end:
            n_parts = data[off + 1]
            o = off + 6 + 2 * n_parts
            o += -o & 7
            for i in range(n_parts):
                s = u16(data, off + 6 + 2 * i)[0]
                got.append(bytes(mv[o:o + s]))
                o += s + (-s & 7)
            off = o
        done += k
    return time.perf_counter() - start


SINK_CHILD = r"""
import socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
total = 0
while True:
    d = c.recv(1 << 20)
    if not d:
        break
    total += len(d)
c.sendall(b"%d" % total)
c.close()
"""

LISTENER_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from streamproto.relink.api import ChannelHandler, ListenerFactory, RelinkEndpoint
from streamproto.relink.config import LinkConfig
config = LinkConfig(window=int(sys.argv[2]), max_queued=int(sys.argv[2]))
ep = RelinkEndpoint("sink", ChannelHandler(), connector_id_size=4, listener_id_size=4,
                    config=config)
def ready(port):
    print(port.getHost().port, flush=True)
TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
    ListenerFactory([ep], config=config)).addCallback(ready)
reactor.run()
"""


def tcp_baseline(n, size, parts):
    child = subprocess.Popen([sys.executable, "-c", SINK_CHILD], stdout=subprocess.PIPE)
    port = int(child.stdout.readline())
    msg = [b"m" * (size // parts)] * parts
    one = codec.encode_message((1,), msg, 4)
    chunk = one * 4096
    s = socket.create_connection(("127.0.0.1", port))
    start = time.perf_counter()
    sent = 0
    while sent < n:
        k = min(4096, n - sent)
        s.sendall(chunk if k == 4096 else one * k)
        sent += k
    s.shutdown(socket.SHUT_WR)
    s.recv(100)
    elapsed = time.perf_counter() - start
    s.close()
    child.wait()
    return elapsed


def _run_each(items, one, child):
    """Run C{one(item)} for each item in turn on the reactor, then stop the child."""
    from twisted.internet import reactor
    from twisted.internet.defer import inlineCallbacks

    @inlineCallbacks
    def go():
        try:
            for item in items:
                yield one(item)
        finally:
            reactor.stop()

    reactor.callWhenRunning(go)
    reactor.run()
    child.terminate()
    child.wait()


def tcp_runs(n, size, parts_list, window, batch):
    """Run the connector here against a listener child, once per parts count."""
    from twisted.internet import reactor
    from twisted.internet.defer import inlineCallbacks

    from streamproto.core.tls import client_endpoint
    from streamproto.relink.api import Connector

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    child = subprocess.Popen([sys.executable, "-c", LISTENER_CHILD, root, str(window)],
                             stdout=subprocess.PIPE)
    port = int(child.stdout.readline())
    config = LinkConfig(window=window, max_queued=window)
    results = []

    @inlineCallbacks
    def one(parts):
        c = Connector(client_endpoint(reactor, "127.0.0.1", port, None), "sink",
                      connector_id_size=4, listener_id_size=4, config=config)
        c.start()
        link = yield c.when_linked()
        ch = link.channel(1)
        msg = [b"m" * (size // parts)] * parts
        start = time.perf_counter()
        sent = 0
        last = None
        while sent < n:
            room = min(ch.room, n - sent, batch)
            if room <= 0:
                yield ch.when_writable()
                continue
            if parts == 1:
                last = ch.send_payloads([msg[0]] * room)
            else:
                last = ch.send_many([msg] * room)
            sent += room
        yield last
        results.append(time.perf_counter() - start)
        yield c.stop()

    _run_each(parts_list, one, child)
    return results


ECHO_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from streamproto.log import MemoryLogStore
from streamproto.relink.api import ListenerFactory
from streamproto.relink.endpoints import server_endpoints
# the server's endpoints with the server's defaults, as twistd relink-server runs them
def ready(port):
    print(port.getHost().port, flush=True)
TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
    ListenerFactory(server_endpoints(MemoryLogStore(reactor), id_size=int(sys.argv[2])))
).addCallback(ready)
reactor.run()
"""


def echo_runs(n, size, windows, id_size=2):
    """
    Round trips through the server's C{echo} endpoint (a child process with
    the server's defaults), once per connector send window: seconds until
    every echo of C{n} messages of C{size} bytes is back.
    """
    from twisted.internet import reactor
    from twisted.internet.defer import Deferred, inlineCallbacks

    from streamproto.core.tls import client_endpoint
    from streamproto.relink.api import Connector

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    child = subprocess.Popen([sys.executable, "-c", ECHO_CHILD, root, str(id_size)],
                             stdout=subprocess.PIPE)
    port = int(child.stdout.readline())
    results = []

    class Echoes(ChannelHandler):
        def __init__(self):
            self.count = 0
            self.done = Deferred()

        def messages_received(self, link, channel_id, messages):
            self.count += len(messages)
            if self.count >= n and not self.done.called:
                self.done.callback(None)

    @inlineCallbacks
    def one(window):
        handler = Echoes()
        config = LinkConfig(window=window, max_queued=window, window_bytes=1 << 30,
                            max_queued_bytes=1 << 30)
        c = Connector(client_endpoint(reactor, "127.0.0.1", port, None), "echo", handler,
                      connector_id_size=id_size, listener_id_size=id_size, config=config)
        c.start()
        link = yield c.when_linked()
        ch = link.channel(1)
        payload = b"e" * size
        start = time.perf_counter()
        sent = 0
        while sent < n:
            room = min(ch.room, n - sent, 8192)
            if room <= 0:
                yield ch.when_writable()
                continue
            ch.send_payloads([payload] * room, ack=None)
            sent += room
        yield handler.done
        results.append(time.perf_counter() - start)
        yield c.stop()

    _run_each(windows, one, child)
    return results


def report(label, n, elapsed, base_elapsed, size):
    rate = n / elapsed
    base = n / base_elapsed
    print(f"{label:<34} {rate:>12,.0f} msg/s {rate * size / 1e6:>8.1f} MB/s   "
          f"baseline {base:>12,.0f} msg/s   ratio {rate / base:.3f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=300_000)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--parts", type=int, default=4, help="parts of the multi-part run")
    p.add_argument("--window", type=int, default=16384)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--mode", choices=["memory", "tcp", "both", "echo"], default="both",
                   help="echo: round trips through the server's echo endpoint with a "
                        "4,096 and a 65,536-message send window (not part of 'both')")
    p.add_argument("--echo-size", type=int, default=100)
    args = p.parse_args(argv)
    n = args.messages
    print(f"relink: {n} messages of {args.size} B, window {args.window}, "
          f"batch {args.batch} (shared machine: figures vary)")
    if args.mode in ("memory", "both"):
        for parts in (1, args.parts):
            e = memory_run(n, args.size, parts, args.window, args.batch)
            b = memory_baseline(n, args.size, parts, args.batch)
            report(f"memory, {parts} part(s), consumed acks", n, e, b, args.size)
    if args.mode in ("tcp", "both"):
        runs = tcp_runs(n, args.size, (1, args.parts), args.window, args.batch)
        for parts, e in zip((1, args.parts), runs):
            b = tcp_baseline(n, args.size, parts)
            report(f"tcp, {parts} part(s), consumed acks", n, e, b, args.size)
    if args.mode == "echo":
        # 4,096: the most a connector could keep in flight before the server
        # stopped failing larger windows (the baseline); 65,536: the Go
        # package's default window
        small, large = echo_runs(n, args.echo_size, (4096, 65536))
        print(f"echo through the server, {args.echo_size} B messages, id size 2:")
        report("  send window 65,536 (vs 4,096)", n, large, small, args.echo_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
