"""
The partition target: the JetStream target (L{StyxNatsTarget}) with every
process in a network namespace of its own (L{test.faults.netns}): the
front-end with its workload client (C{fe}), and each nats-server node
(C{n0}, C{n1}, C{n2}), joined by a router the nemesis cuts.  The client
talks to the front-end over the front-end namespace's loopback, so a cut of
the front-end from the cluster leaves its clients connected to it, as a
front-end losing its uplink would.

The harness's own requests to the front-end (create the log, read it back)
run as a child process in C{fe}'s namespace (C{python -m
test.faults.nstargets create|read ...}); its requests to the nodes
(readiness, the stream leader) run in a thread inside the router's
namespace (L{netns.Fabric.call}).
"""

import os
import sys
import tempfile

from twisted.internet import defer, threads

from test.faults import netns
from test.faults.targets import SEGMENT_MAX_SIZE, StyxNatsTarget
from test.support.natsutil import NatsCluster
from test.support.torture_harness import ROOT, ServerProcess

NODES = ("n0", "n1", "n2")


class NsNatsCluster(NatsCluster):
    """L{NatsCluster} whose node C{i} runs in the namespace of member C{n<i>}."""

    def __init__(self, fabric, size=3, **kwargs):
        self.fabric = fabric
        super().__init__(size, **kwargs)

    def host(self, i):
        return self.fabric.address(f"n{i}")

    def command(self, i):
        return self.fabric.prefix(f"n{i}") + super().command(i)

    # every wait talks to the nodes: from the router's namespace
    def wait_node(self, i, timeout=30.0):
        return self.fabric.call(super().wait_node, i, timeout)

    def wait_ready(self, timeout=30.0):
        return self.fabric.call(super().wait_ready, timeout)

    def wait_placement(self, timeout=30.0):
        return self.fabric.call(super().wait_placement, timeout)

    def wait_streams_settled(self, timeout=30.0):
        return self.fabric.call(super().wait_streams_settled, timeout)

    def stream_leader(self):
        """The name (C{n<i>}) of a stream's leader as a node reports it, or None."""
        def ask():
            for i in range(self.size):
                jsz = self.jsz(i)
                if jsz is None:
                    continue
                for account in jsz.get("account_details") or ():
                    for stream in account.get("stream_detail") or ():
                        leader = (stream.get("cluster") or {}).get("leader")
                        if leader:
                            return leader
            return None
        return self.fabric.call(ask)


class NsServerProcess(ServerProcess):
    """A L{ServerProcess} run in a member's namespace, waited for from inside it."""

    def __init__(self, fabric, member, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fabric = fabric
        self.member = member
        self.prefix = fabric.prefix(member)

    @defer.inlineCallbacks
    def start(self, timeout=30.0):
        """
        Spawn the front-end and wait, from inside its namespace, until it
        accepts connections.  One that exits first (a JetStream front-end
        that cannot reach its cluster at start-up stops with its
        documented exit status 1) is spawned again, as its supervisor
        would, until C{timeout}; its output keeps every start's lines.
        """
        import time
        started = time.monotonic()
        deadline = started + timeout
        self.spawn()
        while True:
            try:
                # short waits: an exited child is seen within a second
                yield threads.deferToThread(
                    self.fabric.call, _wait_port, self.port,
                    max(0.0, min(1.0, deadline - time.monotonic())), member=self.member)
            except TimeoutError:
                if time.monotonic() < deadline:
                    if not self.running:
                        self.spawn()
                    continue
                yield self.kill()
                raise TimeoutError(f"127.0.0.1:{self.port} did not accept connections in "
                                   f"{timeout}s ({self.starts} starts):\n"
                                   + self.output_text()[-2000:])
            except Exception:
                yield self.kill()
                raise
            if not self.running:
                raise RuntimeError(f"server exited:\n{self.output_text()}")
            return time.monotonic() - started


def _wait_port(port, timeout):
    import socket
    import time
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"127.0.0.1:{port} did not accept connections "
                                   f"in {timeout}s")
            time.sleep(0.05)


class StyxPartitionTarget(StyxNatsTarget):
    """
    The JetStream target in namespaces: partitions (L{draw_partition}) and
    flapping links on top of the verbs of L{StyxNatsTarget}.

    @param sync_interval: the nodes' C{sync_interval} (C{always}, or
        None: nats-server's default, 2 minutes).
    """

    def __init__(self, reactor, sync_interval="always", clock=False, log="faults", **kwargs):
        self.fabric = netns.Fabric(("fe",) + NODES)
        super().__init__(reactor, clock=clock, log=log, sync_interval=sync_interval, **kwargs)
        old = self.server
        self.server = NsServerProcess(self.fabric, "fe", reactor, old.plugin, old.data_dir,
                                      args=old.args, env=old.env)

    def make_cluster(self):
        return NsNatsCluster(self.fabric, 3, sync_interval=self.sync_interval)

    def partition_unavailable(self):
        return netns.unavailable()

    def lazy_unavailable(self):
        return super().lazy_unavailable() or netns.unavailable()

    @defer.inlineCallbacks
    def setup(self):
        self.fabric.build()
        yield super().setup()

    def client_prefix(self):
        return self.fabric.prefix("fe")

    # -- the harness's own client, inside fe ------------------------------

    @defer.inlineCallbacks
    def _in_fe(self, *argv):
        from twisted.internet import utils
        command = self.fabric.prefix("fe") + [sys.executable, "-m", "test.faults.nstargets",
                                              *argv]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        out, err, code = yield utils.getProcessOutputAndValue(
            command[0], command[1:], env=env, path=ROOT, reactor=self.reactor)
        if code != 0:
            raise RuntimeError(f"{' '.join(argv[:1])} in fe failed ({code}): "
                               f"{err.decode(errors='replace')[-1500:]}")
        return out

    def create_log(self, **config):
        size = config.get("segment_max_size") or SEGMENT_MAX_SIZE
        return self._in_fe("create", self.url, self.log, str(size))

    def on_cluster(self, function, *args):
        """C{function(*args)} in a thread inside the router's namespace."""
        return threads.deferToThread(self.fabric.call, function, *args)

    @defer.inlineCallbacks
    def read_back(self):
        fd, path = tempfile.mkstemp(prefix="faults-read-")
        os.close(fd)
        try:
            yield self._in_fe("read", self.url, self.log, path)
            return list(_read_frames(path))
        finally:
            os.unlink(path)

    # -- partitions --------------------------------------------------------

    @defer.inlineCallbacks
    def draw_partition(self, rng):
        """
        Cut the network one of four ways, drawn from C{rng}; fires with its
        description.  C{fe} is the front-end (with its clients).
        """
        kind = rng.choice(["front-end", "leader", "split", "bridge"])
        nodes = list(NODES)
        if kind == "front-end":
            self.fabric.cut(["fe"], nodes)
            return "front-end | n0 n1 n2"
        if kind == "leader":
            leader = yield threads.deferToThread(self.cluster.stream_leader)
            lone = leader if leader in nodes else rng.choice(nodes)
            self.fabric.cut([lone], [n for n in nodes if n != lone])
            return f"stream leader {lone} (leader seen: {leader}) | the other nodes"
        if kind == "split":
            lone = rng.choice(nodes)
            rest = [n for n in nodes if n != lone]
            if rng.random() < 0.5:
                side_a, side_b = ["fe", lone], rest
            else:
                side_a, side_b = [lone], ["fe"] + rest
            self.fabric.cut(side_a, side_b)
            return f"{' '.join(side_a)} | {' '.join(side_b)}"
        hub = rng.choice(nodes)
        b, c = [n for n in nodes if n != hub]
        self.fabric.cut([b], [c])
        return f"bridge: {hub} sees {b} and {c}, {b} | {c}"

    def heal_partition(self):
        self.fabric.heal()

    def flappable(self):
        return ["fe"] + list(NODES)

    def set_link(self, member, up):
        self.fabric.link(member, up)

    # -- the end -------------------------------------------------------------

    def heal_cluster(self, power_cut=True):
        self.fabric.heal()
        return super().heal_cluster(power_cut=power_cut)

    @defer.inlineCallbacks
    def teardown(self):
        try:
            yield super().teardown()
        finally:
            self.fabric.teardown()

    def abort(self):
        try:
            super().abort()
        finally:
            self.fabric.teardown()


def _read_frames(path):
    with open(path, "rb") as f:
        data = f.read()
    at = 0
    while at < len(data):
        size = int.from_bytes(data[at:at + 4], "big")
        yield data[at + 4:at + 4 + size]
        at += 4 + size


def main(argv):
    """
    Run inside C{fe}: C{create URL LOG SEGMENT_SIZE} or C{read URL LOG OUT}
    (Styx), C{pravega-create PORT SEGMENT}, or C{resume PORT SESSION LAST}
    (a reliable-stream session; prints why it did not resume, nothing if
    it did).
    """
    from twisted.internet import task

    from streamproto.styx.api_client import StyxClient
    from test.faults import logtargets

    @defer.inlineCallbacks
    def styx(reactor):
        client = StyxClient(argv[1], reactor=reactor)
        try:
            if argv[0] == "create":
                yield client.create_log(argv[2], segment_max_size=int(argv[3]))
            else:
                records = yield client.read_records(argv[2])
                with open(argv[3], "wb") as f:
                    for record in records:
                        record = bytes(record)
                        f.write(len(record).to_bytes(4, "big") + record)
        finally:
            yield client.close()

    def pravega_create(reactor):
        return logtargets.create_segment(logtargets.local_endpoint(reactor, int(argv[1])),
                                         argv[2])

    @defer.inlineCallbacks
    def resume(reactor):
        why = yield logtargets.resume_session(
            reactor, logtargets.local_endpoint(reactor, int(argv[1])), argv[2], int(argv[3]))
        sys.stdout.write(why or "")

    commands = {"create": styx, "read": styx, "pravega-create": pravega_create,
                "resume": resume}
    task.react(commands[argv[0]])


if __name__ == "__main__":
    main(sys.argv[1:])
