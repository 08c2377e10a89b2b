"""
Stateless front-ends on one JetStream cluster (C{--store nats://...}):
the option on every plugin and the umbrella (usage errors included), two
C{twistd} processes serving the same logs (a record acknowledged through
one readable through the other at once), one of them killed with SIGKILL
under a writer that goes on through the other, and a cluster that cannot
be reached at start-up (one line, exit 1).
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from twisted.python import usage
from twisted.trial import unittest

from streamproto import tap as umbrella
from test.support.natsutil import shared_cluster, unique_prefix
from test.support.netutil import free_ports
from test.styx.test_styx_http import BINARY, unbinary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWISTD = [sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]
PLUGINS = ["styx", "pravega", "lumberjack", "reliable", "relink"]


def plugin_options(package):
    module = __import__(f"streamproto.{package}.tap", fromlist=["Options"])
    return module.Options()


class StoreOptionTests(unittest.SynchronousTestCase):

    def test_every_plugin_takes_it(self):
        for package in PLUGINS:
            options = plugin_options(package)
            options.parseOptions(["--store", "nats://n1:4222,n2,n3?prefix=prod"])
            url = options["store-url"]
            self.assertEqual(url.servers, ("nats://n1:4222", "nats://n2:4222",
                                           "nats://n3:4222"), package)
            self.assertEqual(url.prefix, "prod")

    def test_usage_errors(self):
        for argv, why in [
                (["--store", "nats://h:99999"], "port 99999 out of range"),
                (["--store", "nats://h?replicas=7"], "replicas must be 1 to 5"),
                (["--store", "redis://h"], "expected nats://"),
                (["--store-ca", "/etc/hostname"], "go with a tls://"),
                (["--store", "tls://h", "--store-ca", "/nonexistent.pem"], "cannot read it"),
                (["--store", "tls://h", "--store-cert", "/etc/hostname"], "give both")]:
            for package in ("styx", "pravega"):
                with self.assertRaises(usage.UsageError) as caught:
                    plugin_options(package).parseOptions(argv)
                self.assertIn(why, str(caught.exception), (package, argv))

    def test_reliable_keeps_its_session_stores(self):
        for value in ("sqlite", "memory"):
            options = plugin_options("reliable")
            options.parseOptions(["--store", value, "--data", self.mktemp()])
            self.assertEqual((options["store"], options["store-url"]), (value, None))
        with self.assertRaises(usage.UsageError) as caught:
            plugin_options("reliable").parseOptions(["--store", "mysql"])
        self.assertIn("expected sqlite or memory or nats://", str(caught.exception))

    def test_umbrella_hands_it_to_every_server(self):
        options = umbrella.Options()
        options.parseOptions(["--store", "nats://n1,n2,n3"])
        for name, sub in options.server_options.items():
            self.assertEqual(str(sub["store-url"]), "nats://n1:4222,n2:4222,n3:4222", name)

    def test_umbrella_store_is_shared(self):
        path = self.mktemp()
        with open(path, "w") as f:
            f.write('[styx-server]\nstore = "nats://elsewhere"\n')
        with self.assertRaises(usage.UsageError) as caught:
            umbrella.Options().parseOptions(["--config", path, "--store", "nats://h"])
        self.assertIn("shared by every server", str(caught.exception))
        # reliable's own table may choose its session store
        with open(path, "w") as f:
            f.write('[reliable-stream-server]\nstore = "memory"\n')
        options = umbrella.Options()
        options.parseOptions(["--config", path, "--store", "nats://h"])
        self.assertEqual(options.server_options["reliable-stream-server"]["store"], "memory")
        self.assertEqual(str(options.server_options["styx-server"]["store-url"]),
                         "nats://h:4222")


def get_binary(url, timeout=30):
    """GET C{url} as binary records (int32 big-endian size, then the bytes)."""
    request = urllib.request.Request(
        url, headers={"Accept": BINARY})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, response.read()


def get(url, data=None, timeout=10):
    request = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status, response.read()


class FrontEndTests(unittest.SynchronousTestCase):
    """Real twistd processes on the shared test cluster."""

    def setUp(self):
        self.cluster = shared_cluster()
        self.store = self.cluster.url + f"?prefix={unique_prefix(self)}"
        self.env = dict(os.environ, PYTHONPATH=ROOT)
        self.processes = []

    def start(self, plugin, *args, wait_url=None):
        directory = self.mktemp()
        os.makedirs(directory)
        log = open(os.path.join(directory, "out.log"), "wb")
        self.addCleanup(log.close)
        process = subprocess.Popen(TWISTD + ["-n", "--pidfile=", plugin, *args], cwd=directory,
                                   env=self.env, stdout=log, stderr=subprocess.STDOUT)

        def stop():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.addCleanup(stop)
        process.log_path = os.path.join(directory, "out.log")
        self.processes.append(process)
        if wait_url:
            deadline = time.monotonic() + 60
            while True:
                if process.poll() is not None:
                    self.fail(f"{plugin} exited: {self.output(process)}")
                try:
                    status, _ = get(wait_url, timeout=2)
                    if status == 200:
                        break
                except (OSError, urllib.error.HTTPError):
                    pass
                if time.monotonic() > deadline:
                    self.fail(f"{plugin} not ready: {self.output(process)}")
                time.sleep(0.1)
        return process

    def output(self, process):
        with open(process.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def styx(self):
        port, metrics = free_ports(2)
        self.start("styx-server", "--store", self.store,
                   "--port", f"tcp:{port}:interface=127.0.0.1",
                   "--metrics", f"tcp:{metrics}:interface=127.0.0.1",
                   wait_url=f"http://127.0.0.1:{metrics}/ready")
        return f"http://127.0.0.1:{port}"

    def test_two_styx_front_ends_serve_the_same_logs(self):
        a, b = self.styx(), self.styx()
        status, _ = get(f"{a}/logs", data=b"name=shared")
        self.assertEqual(status, 200)
        for i in range(20):
            # written through one, read through the other at once
            front, back = (a, b) if i % 2 == 0 else (b, a)
            status, body = get(f"{front}/logs/shared/records", data=b"record %d" % i)
            self.assertEqual(status, 200)
            status, body = get(f"{back}/logs/shared")
            self.assertEqual(json.loads(body)["end_position"], i + 1, (front, back))
            status, body = get(f"{back}/logs/shared/records?position={i}&limit=1")
            self.assertEqual(body.rstrip(b"\n"), b"record %d" % i)
        names = [entry["name"] for entry in json.loads(get(f"{b}/logs")[1])]
        self.assertEqual(names, ["shared"])

    def test_kill_9_of_a_front_end_under_a_writer(self):
        """
        A writer (C{StyxClient} over both front-ends, one write in flight)
        while the front-end it uses is killed with SIGKILL: it goes on through
        the other, every write that was acknowledged is stored exactly once
        and in order, and a write whose answer was lost is stored at most
        once (the client does not send it again: it may be stored).
        """
        a, b = self.styx(), self.styx()
        victim = self.processes[-2]
        self.assertEqual(get(f"{a}/logs", data=b"name=killed")[0], 200)
        script = (
            "import json, sys, time\n"
            "from twisted.internet import defer, task\n"
            "from streamproto.styx.api_client import StyxClient\n"
            "@defer.inlineCallbacks\n"
            "def main(reactor, urls, n):\n"
            "    client = StyxClient(urls.split(','), reactor)\n"
            "    for i in range(int(n)):\n"
            "        try:\n"
            "            yield client.write_records('killed', [b'%d-%d' % (i, j) for j in range(20)])\n"
            "            ok = True\n"
            "        except Exception as e:\n"
            "            ok = False\n"
            "        print(json.dumps({'batch': i, 'ok': ok, 't': time.monotonic(),\n"
            "                          'via': client.base_url}), flush=True)\n"
            "        yield task.deferLater(reactor, 0.005, lambda: None)\n"
            "task.react(main, sys.argv[1:])\n")
        writer = subprocess.Popen([sys.executable, "-c", script, f"{a},{b}", "400"],
                                  env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.addCleanup(lambda: writer.poll() is None and writer.kill())
        results, killed_at = [], None
        for line in writer.stdout:
            results.append(json.loads(line))
            if killed_at is None and len(results) == 100:
                victim.kill()       # SIGKILL: no drain, no goodbye
                killed_at = time.monotonic()
        self.assertEqual(writer.wait(60), 0, writer.stderr.read().decode(errors="replace"))
        self.assertEqual(len(results), 400)
        acked = [r["batch"] for r in results if r["ok"]]
        unknown = [r["batch"] for r in results if not r["ok"]]
        after = [r for r in results if r["ok"] and r["t"] > killed_at]
        self.assertTrue(after and all(r["via"] == b for r in after))
        self.assertLessEqual(len(unknown), 2)      # at most the write in flight, and its retry
        # everything, read back through the survivor
        status, body = get_binary(f"{b}/logs/killed/records?position=0&count=-1")
        stored = [r.decode() for r in unbinary(body)]
        batches = [s.split("-")[0] for s in stored[::20]]
        for i in range(0, len(stored), 20):
            chunk = stored[i:i + 20]
            self.assertEqual(chunk, [f"{chunk[0].split('-')[0]}-{j}" for j in range(20)])
        kept = [int(x) for x in batches]
        self.assertEqual([x for x in kept if x in acked], acked)   # each once, in order
        self.assertTrue(set(kept) <= set(acked) | set(unknown))
        print(f"\nstyx front-end kill -9: first ack through the other "
              f"{after[0]['t'] - killed_at:.2f} s later; {len(acked)} batches acknowledged, "
              f"{len(unknown)} unknown ({len(set(kept) & set(unknown))} of them stored)")

    def test_umbrella_on_the_cluster(self):
        ports = dict(zip(("styx", "metrics", "controller", "pravega"), free_ports(4)))
        self.start("streamproto", "--store", self.store, "--only", "styx-server,pravega-server",
                   "--listen", f"styx-server=tcp:{ports['styx']}:interface=127.0.0.1",
                   "--listen", f"pravega-server=tcp:{ports['pravega']}:interface=127.0.0.1",
                   "--pravega-controller", f"tcp:{ports['controller']}:interface=127.0.0.1",
                   "--metrics", f"tcp:{ports['metrics']}:interface=127.0.0.1",
                   wait_url=f"http://127.0.0.1:{ports['metrics']}/ready")
        styx = f"http://127.0.0.1:{ports['styx']}"
        self.assertEqual(get(f"{styx}/logs", data=b"name=via-umbrella")[0], 200)
        from streamproto.log.natsreader import JetStreamReader
        from streamproto.log.storeurl import parse_store_url
        url = parse_store_url(self.store)
        self.assertIn("via-umbrella", JetStreamReader(url.servers, url.prefix).names())

    def test_unreachable_cluster_at_start(self):
        nats, port = free_ports(2)
        process = self.start("styx-server", "--store", f"nats://127.0.0.1:{nats}",
                             "--port", f"tcp:{port}:interface=127.0.0.1")
        try:
            status = process.wait(60)
        except subprocess.TimeoutExpired:
            self.fail("styx-server kept running without its store: " + self.output(process))
        self.assertEqual(status, 1)
        out = self.output(process)
        critical = [line for line in out.splitlines() if "cannot start" in line]
        self.assertEqual(len(critical), 1, out)
        self.assertIn("log store nats://127.0.0.1:", critical[0])
        self.assertIn("cannot be reached", critical[0])
        self.assertNotIn("Traceback", out)

    def test_two_pravega_front_ends_share_scopes_and_streams(self):
        """
        The controller's state lives in the store: a stream created through
        one pravega-server's controller is served by the other's, and the
        events one segment store took are read through the other.
        """
        servers = []
        # four distinct ports (picked one by one, two picks once were one
        # port: the second server's controller answered as another server)
        ports = iter(free_ports(4))
        for _ in range(2):
            store_port, controller_port = next(ports), next(ports)
            self.start("pravega-server", "--store", self.store,
                       "--port", f"tcp:{store_port}:interface=127.0.0.1",
                       "--controller", f"tcp:{controller_port}:interface=127.0.0.1",
                       "--advertise", f"127.0.0.1:{store_port}")
            servers.append((store_port, controller_port))
        for store_port, controller_port in servers:
            self.wait_port(store_port)
            self.wait_port(controller_port)

        def pravega(server, *argv, input=None):
            store_port, controller_port = server
            result = subprocess.run(
                [sys.executable, "-m", "streamproto", "pravega", "-s",
                 f"127.0.0.1:{store_port}", "-c", f"127.0.0.1:{controller_port}", *argv],
                env=self.env, capture_output=True, input=input, timeout=120)
            self.assertEqual(result.returncode, 0, result.stderr.decode())
            return result.stdout.decode()

        a, b = servers
        pravega(a, "scope", "create", "shared")
        pravega(a, "stream", "create", "shared/events", "--segments", "2")
        self.assertEqual(pravega(b, "stream", "list", "shared").split(), ["shared/events"])
        pravega(a, "write", "shared/events/0.#epoch.0", input=b"one\ntwo\n")
        self.assertEqual(pravega(b, "read", "shared/events/0.#epoch.0").split(),
                         ["one", "two"])
        # a change through b, seen through a
        pravega(b, "stream", "create", "shared/more")
        self.assertEqual(pravega(a, "stream", "list", "shared").split(),
                         ["shared/events", "shared/more"])

    def wait_port(self, port):
        import socket
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.fail(f"nothing listens on {port}")
                time.sleep(0.1)


class TLSStoreTests(unittest.SynchronousTestCase):
    """C{--store tls://...}: the servers verified, a client certificate shown."""

    def setUp(self):
        from test.support.natsutil import NatsCluster
        from test.support.tlsutil import certs
        self.c = certs()
        self.cluster = NatsCluster(1, tls=(self.c.server_cert, self.c.server_key, self.c.ca))
        self.cluster.start()
        self.addCleanup(self.cluster.stop)
        self.env = dict(os.environ, PYTHONPATH=ROOT)

    def run_styx(self, *store_args):
        port, metrics = free_ports(2)
        directory = self.mktemp()
        os.makedirs(directory)
        out = open(os.path.join(directory, "out.log"), "wb")
        self.addCleanup(out.close)
        process = subprocess.Popen(
            TWISTD + ["-n", "--pidfile=", "styx-server", *store_args,
                      "--port", f"tcp:{port}:interface=127.0.0.1",
                      "--metrics", f"tcp:{metrics}:interface=127.0.0.1"],
            cwd=directory, env=self.env, stdout=out, stderr=subprocess.STDOUT)

        def stop():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(30)
        self.addCleanup(stop)
        process.log_path = os.path.join(directory, "out.log")
        return process, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics}/ready"

    def test_tls_store(self):
        url = f"tls://localhost:{self.cluster.ports[0]}"
        process, styx, ready = self.run_styx(
            "--store", url, "--store-ca", self.c.ca, "--store-cert", self.c.client_cert,
            "--store-key", self.c.client_key)
        deadline = time.monotonic() + 60
        while True:
            self.assertIsNone(process.poll(), open(process.log_path).read())
            try:
                if get(ready, timeout=2)[0] == 200:
                    break
            except (OSError, urllib.error.HTTPError):
                pass
            self.assertLess(time.monotonic(), deadline, open(process.log_path).read())
            time.sleep(0.1)
        self.assertEqual(get(f"{styx}/logs", data=b"name=secure")[0], 200)
        self.assertEqual(get(f"{styx}/logs/secure/records", data=b"over TLS")[0], 200)
        self.assertEqual(get(f"{styx}/logs/secure/records?position=0")[1].rstrip(),
                         b"over TLS")

    def test_wrong_ca_is_a_clean_start_failure(self):
        url = f"tls://localhost:{self.cluster.ports[0]}"
        process, _, _ = self.run_styx("--store", url, "--store-ca", self.c.other_ca,
                                      "--store-cert", self.c.client_cert,
                                      "--store-key", self.c.client_key)
        self.assertEqual(process.wait(60), 1)
        text = open(process.log_path).read()
        self.assertIn("cannot be reached", text)
        self.assertIn("CERTIFICATE_VERIFY_FAILED", text.upper().replace(" ", "_"))
