"""
Typed configuration (issue #18): every server is built by its tap's
C{build_service(config, store, reactor)} from a frozen config, with the
reactor it is given; the umbrella makes those configs from values, not
from a rebuilt command line.  Nothing listens for real: the reactor is a
L{MemoryReactorClock}.
"""

import dataclasses
import tempfile

from twisted.internet.testing import MemoryReactorClock
from twisted.python import usage
from twisted.trial import unittest

from streamproto import tap as umbrella
from streamproto.core.auth import ALLOW_ALL
from streamproto.core.clock import default_reactor
from streamproto.core.config import set_option
from streamproto.core.ops import TrackingFactory
from streamproto.core.stores import StoreService
from streamproto.core.tap import ServerConfig, as_config
from streamproto.log.memory import MemoryLogStore
from streamproto.lumberjack import tap as lumberjack
from streamproto.pravega import tap as pravega
from streamproto.pravega.controller import ControllerService
from streamproto.reliable import tap as reliable
from streamproto.relink import tap as relink
from streamproto.styx import tap as styx


class DefaultReactorTests(unittest.SynchronousTestCase):
    def test_given_or_global(self):
        from twisted.internet import reactor
        clock = MemoryReactorClock()
        self.assertIs(default_reactor(clock), clock)
        self.assertIs(default_reactor(), reactor)
        self.assertIs(default_reactor(None), reactor)
        # "no reactor" (the synchronous bridge) stays what it is
        self.assertIs(default_reactor(False), False)


class BuildTestBase(unittest.SynchronousTestCase):
    """Start a service on a L{MemoryReactorClock}: what listens where."""

    def setUp(self):
        self.reactor = MemoryReactorClock()
        self.store = MemoryLogStore(self.reactor)
        self.data = tempfile.mkdtemp()

    def start(self, top):
        top.privilegedStartService()
        top.startService()
        self.addCleanup(self.stop, top)
        return [(port, interface, factory)
                for port, factory, _backlog, interface in self.reactor.tcpServers]

    def stop(self, top):
        if top.running:
            self.successResultOf(top.stopService())

    def listening(self, top):
        return [(port, interface) for port, interface, _ in self.start(top)]

    def served(self, factory):
        """The server factory behind a listener's L{TrackingFactory}."""
        self.assertIsInstance(factory, TrackingFactory)
        return factory.wrappedFactory


class StyxBuildTests(BuildTestBase):
    def test_listens_where_the_config_says(self):
        config = styx.StyxServerConfig(
            ports=("tcp:7123", "tcp:8123:interface=127.0.0.1"), data=self.data,
            metrics="tcp:9100:interface=127.0.0.1", timeout=9, max_body_size=1000,
            cors_origins=())
        top = styx.build_service(config, store=self.store, reactor=self.reactor)
        servers = self.start(top)
        self.assertEqual([(p, i) for p, i, _ in servers],
                         [(7123, ""), (8123, "127.0.0.1"), (9100, "127.0.0.1")])
        site = self.served(servers[0][2])
        self.assertEqual((site.max_body_size, site.resource.timeout), (1000, 9))
        self.assertEqual(site.resource.cors_origins, ())
        self.assertIs(site.resource.authorizer, ALLOW_ALL)     # without a policy
        # the reactor given is the one the API times its streams with
        self.assertIs(site.resource.clock, self.reactor)
        self.assertIs(top.clock, self.reactor)
        # a shared store: none of its own
        self.assertFalse([s for s in top if isinstance(s, StoreService)])

    def test_config_is_frozen(self):
        config = styx.StyxServerConfig(ports=("tcp:1",))
        with self.assertRaises(dataclasses.FrozenInstanceError):
            config.timeout = 5

    def test_make_service_takes_the_reactor(self):
        options = styx.Options()
        options.parseOptions(["--data", self.data, "--port", "tcp:7555", "--timeout", "7"])
        self.assertIsInstance(options.config, styx.StyxServerConfig)
        self.assertEqual((options.config.ports, options.config.timeout), (("tcp:7555",), 7))
        top = styx.makeService(options, store=self.store, reactor=self.reactor)
        self.assertEqual(self.listening(top), [(7555, "")])


class PravegaBuildTests(BuildTestBase):
    def test_segment_store_only(self):
        config = pravega.PravegaServerConfig(ports=("tcp:12345:interface=127.0.0.1",),
                                             data=self.data, controller="none",
                                             read_wait=5.0, authorizer=ALLOW_ALL)
        top = pravega.build_service(config, store=self.store, reactor=self.reactor)
        [(port, interface, factory)] = self.start(top)
        self.assertEqual((port, interface), (12345, "127.0.0.1"))
        factory = self.served(factory)
        self.assertIs(factory.clock, self.reactor)
        self.assertFalse([s for s in top if isinstance(s, ControllerService)])

    def test_controller_on_the_reactor(self):
        """The controller (not started: it binds with gRPC) gets the reactor too."""
        options = pravega.Options()
        options.parseOptions(["--data", self.data, "--port", "tcp:12346",
                              "--controller", "tcp:9091:interface=127.0.0.1"])
        config = options.config
        self.assertEqual((config.controller_address, config.advertise_address,
                          config.controller_default),
                         (("127.0.0.1", 9091), ("127.0.0.1", 12346), False))
        top = pravega.build_service(config, store=self.store, reactor=self.reactor)
        [controller] = [s for s in top if isinstance(s, ControllerService)]
        self.assertIs(controller.reactor, self.reactor)
        self.assertEqual((controller.host, controller.port), ("127.0.0.1", 9091))

    def test_default_controller_not_with_a_shared_store(self):
        options = pravega.Options()
        options.parseOptions(["--data", self.data])
        self.assertTrue(options.config.controller_default)
        top = pravega.build_service(options.config, store=self.store, reactor=self.reactor)
        self.assertFalse([s for s in top if isinstance(s, ControllerService)])
        self.assertEqual(self.listening(top), [(12345, "")])


class LumberjackBuildTests(BuildTestBase):
    def test_listens_where_the_config_says(self):
        config = lumberjack.LumberjackServerConfig(
            ports=("tcp:5044", "tcp:5045"), data=self.data, log="beats", max_window=7,
            authorizer=ALLOW_ALL)
        top = lumberjack.build_service(config, store=self.store, reactor=self.reactor)
        servers = self.start(top)
        self.assertEqual([(p, i) for p, i, _ in servers], [(5044, ""), (5045, "")])
        factory = self.served(servers[0][2])
        self.assertEqual((factory.max_window, factory.sink.log_name), (7, "beats"))
        self.assertIs(factory.sink.store, self.store)
        self.assertIs(factory.clock, self.reactor)


class ReliableBuildTests(BuildTestBase):
    def test_listens_where_the_config_says(self):
        config = reliable.ReliableServerConfig(
            ports=("tcp:7341:interface=127.0.0.1",), data=self.data, store="memory",
            window=3, metrics="tcp:9101", authorizer=ALLOW_ALL)
        # the shared log store is not used: its sessions are in memory here
        top = reliable.build_service(config, store=self.store, reactor=self.reactor)
        servers = self.start(top)
        self.assertEqual([(p, i) for p, i, _ in servers], [(7341, "127.0.0.1"), (9101, "")])
        factory = self.served(servers[0][2])
        self.assertEqual(factory.window, 3)
        self.assertIs(factory.clock, self.reactor)
        self.assertIsInstance(factory.store, reliable.MemorySessionStore)


class RelinkBuildTests(BuildTestBase):
    def test_listens_where_the_config_says(self):
        config = relink.RelinkServerConfig(ports=("tcp:7350",), data=self.data, window=5,
                                           link_timeout=30, authorizer=ALLOW_ALL)
        top = relink.build_service(config, store=self.store, reactor=self.reactor)
        [(port, interface, factory)] = self.start(top)
        self.assertEqual((port, interface), (7350, ""))
        factory = self.served(factory)
        self.assertIs(factory.clock, self.reactor)
        self.assertEqual((factory.config.window, factory.config.link_timeout), (5, 30))
        self.assertEqual(sorted(factory.endpoints), ["echo", "log", "log-tx"])


class UmbrellaConfigTests(unittest.SynchronousTestCase):
    def write(self, text):
        path = self.mktemp()
        with open(path, "w") as f:
            f.write(text)
        return path

    def test_configs_are_typed(self):
        path = self.write('[styx-server]\nmax-body-size = 1000\ncors-origin = ["none"]\n'
                          '[lumberjack-server]\nmax-frame = 4194304\n'
                          '[pravega-server]\ncontroller = "none"\n')
        o = umbrella.Options()
        o.parseOptions(["--config", path, "--data", self.mktemp(),
                        "--listen", "styx-server=tcp:7000", "--listen", "styx-server=tcp:7001"])
        configs = o.server_configs
        self.assertEqual({name: type(c) for name, c in configs.items()}, {
            "styx-server": styx.StyxServerConfig,
            "pravega-server": pravega.PravegaServerConfig,
            "lumberjack-server": lumberjack.LumberjackServerConfig,
            "reliable-stream-server": reliable.ReliableServerConfig,
            "relink-server": relink.RelinkServerConfig})
        self.assertEqual(configs["styx-server"].ports, ("tcp:7000", "tcp:7001"))
        self.assertEqual(configs["styx-server"].max_body_size, 1000)
        self.assertEqual(configs["styx-server"].cors_origins, ())
        self.assertEqual(configs["lumberjack-server"].max_frame, 4194304)
        self.assertEqual(configs["pravega-server"].controller, "none")
        for config in configs.values():
            self.assertEqual(config.data, o["data"])

    def test_same_config_as_the_plugin(self):
        """A table gives the umbrella's server the config its own plugin makes of it."""
        path = self.write('[lumberjack-server]\nmax-frame = 4194304\nlog = "beats"\n'
                          'port = ["tcp:5"]\n'
                          '[relink-server]\nlog = "links-{channel}"\nwindow = 8\n'
                          '[styx-server]\ntimeout = 9\nlog_max_size = 1000000\n')
        data = self.mktemp()
        o = umbrella.Options()
        o.parseOptions(["--config", path, "--data", data])
        for name, module in umbrella.available_servers():
            if name in ("lumberjack-server", "relink-server", "styx-server"):
                sub = module.Options()
                sub.parseOptions(["--config", path, "--data", data])
                self.assertEqual(o.server_configs[name], sub.config, name)

    def test_usage_errors_name_the_server(self):
        cases = [
            ('[styx-server]\nmax-body-size = -5\n',
             "styx-server: Parameter type enforcement failed: max-body-size must be positive"),
            ('[lumberjack-server]\nlog = "no/slash"\n', "lumberjack-server: "),
            ('[pravega-server]\nmax-frame-size = 99999999999\n',
             "pravega-server: --max-frame-size must be at most"),
        ]
        for text, expected in cases:
            with self.assertRaises(usage.UsageError) as caught:
                umbrella.Options().parseOptions(["--config", self.write(text),
                                                 "--data", self.mktemp()])
            self.assertTrue(str(caught.exception).startswith(expected),
                            (expected, str(caught.exception)))

    def test_make_service_on_the_reactor(self):
        reactor = MemoryReactorClock()
        o = umbrella.Options()
        o.parseOptions(["--data", self.mktemp(), "--only", "styx-server,relink-server",
                        "--metrics", "tcp:9180:interface=127.0.0.1",
                        "--listen", "styx-server=tcp:7123:interface=127.0.0.1"])
        top = umbrella.makeService(o, reactor=reactor)
        self.assertIs(top.clock, reactor)
        self.assertIsInstance(list(top)[0], StoreService)
        self.assertFalse(reactor.tcpServers)
        top.privilegedStartService()
        top.startService()
        self.assertEqual(sorted((port, interface) for port, _, _, interface in reactor.tcpServers),
                         [(7123, "127.0.0.1"), (7350, ""), (9180, "127.0.0.1")])
        self.successResultOf(top.stopService())
        self.assertFalse(top.running)


class SetOptionTests(unittest.SynchronousTestCase):
    """L{set_option}: values set as the command line would set them."""

    def test_coerced_with_the_same_error(self):
        options = styx.Options()
        set_option(options, "max-body-size", "1000")
        set_option(options, "cors-origin", "https://a.example")
        set_option(options, "port", "tcp:1")
        self.assertEqual((options["max-body-size"], options["cors-origin"], options["port"]),
                         (1000, ["https://a.example"], ["tcp:1"]))
        with self.assertRaises(usage.UsageError) as direct:
            set_option(styx.Options(), "max-body-size", "-5")
        with self.assertRaises(usage.UsageError) as parsed:
            styx.Options().parseOptions(["--max-body-size", "-5"])
        self.assertEqual(str(direct.exception), str(parsed.exception))

    def test_plain_string_options(self):
        options = lumberjack.Options()
        set_option(options, "log", "beats")
        self.assertEqual(options["log"], "beats")


class AsConfigTests(unittest.SynchronousTestCase):
    def test_options_or_config(self):
        config = ServerConfig(ports=("tcp:1",))
        self.assertIs(as_config(config), config)
        options = relink.Options()
        options.parseOptions(["--data", tempfile.mkdtemp()])
        self.assertIs(as_config(options), options.config)
        self.assertEqual(options.config.ports, ("tcp:7350",))
