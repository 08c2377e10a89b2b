"""
The status page at C{/} of the metrics site: its data (C{/status.json},
the C{streamproto status} summary sampled on demand), the page itself (no
other origin contacted), and the page rendered by a real headless browser
(Debian's C{chromium}) from a running server's live metrics.

Under CI (C{CI=true}) a missing browser fails the test: C{.ci/run} installs
it.  Elsewhere the test is skipped, saying so.
"""

import html.parser
import json
import os
import re
import shutil
import tempfile

import treq
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import defer, reactor, task
from twisted.internet.task import Clock
from twisted.trial import unittest
from twisted.web.resource import Resource
from twisted.web.test.requesthelper import DummyRequest

from streamproto.core import accelerator
from streamproto.core.statuspage import PAGE, StatusHistory, install_status_page
from streamproto.styx import tap as styx_tap
from streamproto.styx.api_client import StyxClient
from test.support.ciutil import missing
from test.support.netutil import ProcessOutput
from test.support.test_ops_support import RunningService

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def metrics_text(records_in, end, size, open_=1, fsyncs=(0, 0.0), internal=False):
    text = (
        "# TYPE streamproto_connections_open gauge\n"
        f'streamproto_connections_open{{server="styx-server"}} {open_}\n'
        "# TYPE streamproto_records_in counter\n"
        f'streamproto_records_in_total{{server="styx-server"}} {records_in}\n'
        "# TYPE streamproto_fsync_seconds histogram\n"
        f"streamproto_fsync_seconds_count {fsyncs[0]}\n"
        f"streamproto_fsync_seconds_sum {fsyncs[1]}\n"
        "# TYPE streamproto_log_end_position gauge\n"
        f'streamproto_log_end_position{{log="events"}} {end}\n'
        "# TYPE streamproto_log_size_bytes gauge\n"
        f'streamproto_log_size_bytes{{log="events"}} {size}\n')
    if internal:
        text += 'streamproto_log_size_bytes{log="pravega-controller"} 10\n'
    return text


class HistoryTests(unittest.SynchronousTestCase):
    def setUp(self):
        self.clock = Clock()
        self.clock.advance(1000)
        self.text = metrics_text(0, 0, 0)
        self.history = StatusHistory(
            self.clock, lambda: text_string_to_metric_families(self.text), window=10,
            min_interval=1)

    def test_rates_and_history(self):
        first = self.history.snapshot()
        self.assertIsNone(first["rates"])
        self.assertEqual(first["history"], [])
        self.clock.advance(2)
        self.text = metrics_text(200, 200, 4000, fsyncs=(10, 0.05))
        s = self.history.snapshot()
        self.assertEqual(s["rates"]["servers"]["styx-server"]["records_in"], 100.0)
        self.assertEqual(s["rates"]["logs"]["events"], {"records": 100.0, "bytes": 2000.0})
        self.assertAlmostEqual(s["rates"]["fsync_ms"], 5.0)
        self.assertEqual(len(s["history"]), 1)
        point = s["history"][0]
        self.assertEqual((point["t"], point["logs"]["events"]), (1002, 100.0))
        self.assertEqual(point["servers"]["styx-server"]["open"], 1)
        json.dumps(s)    # the document is JSON as it is

    def test_one_sample_per_interval_and_a_bounded_window(self):
        for _ in range(50):
            self.history.snapshot()
            self.clock.advance(0.25)    # four asks a second: one sample a second
        points = self.history.points
        self.assertLessEqual(len(points), 11)   # 10 s of 1 s samples
        self.assertGreaterEqual(len(points), 9)
        times = [p["t"] for p in points]
        self.assertGreaterEqual(min(b - a for a, b in zip(times, times[1:])), 1)
        self.assertEqual(len(self.history.samples), 2)     # whole summaries: two

    def test_internal_logs_summed(self):
        self.text = metrics_text(0, 0, 0, internal=True)
        s = self.history.snapshot()
        self.assertEqual(list(s["logs"]), ["events"])
        self.assertEqual((s["internal_logs"]["count"], s["internal_logs"]["size"]), (1, 10))


class PageTests(unittest.SynchronousTestCase):
    def render(self, path):
        root = Resource()
        install_status_page(root, Clock(), lambda: text_string_to_metric_families(
            metrics_text(1, 1, 1)))
        request = DummyRequest([path])
        body = root.getChildWithDefault(path, request).render(request)
        return request, body

    def test_page(self):
        request, body = self.render(b"")
        self.assertEqual(body, PAGE)
        self.assertEqual(request.responseHeaders.getRawHeaders(b"content-type"),
                         [b"text/html; charset=utf-8"])
        csp = request.responseHeaders.getRawHeaders(b"content-security-policy")[0]
        self.assertIn(b"default-src 'none'", csp)
        self.assertIn(b"connect-src 'self'", csp)

    def test_nothing_from_elsewhere(self):
        """No script, style, image or font from another origin: the page works offline."""
        text = PAGE.decode()
        self.assertNotRegex(text, r"<(script|link|img|iframe)[^>]*\b(src|href)=")
        self.assertNotIn("@import", text)
        hosts = set(re.findall(r"(?:https?:)?//([\w.-]+)", text))
        self.assertEqual(hosts, {"www.w3.org"})   # the SVG namespace: a name, never fetched
        self.assertIn('fetch("status.json"', text)

    def test_json(self):
        request, body = self.render(b"status.json")
        self.assertEqual(request.responseHeaders.getRawHeaders(b"content-type"),
                         [b"application/json"])
        self.assertEqual(json.loads(body)["logs"]["events"]["end"], 1)


def find_browser():
    """A headless-capable Chromium, or None."""
    configured = os.environ.get("STREAMPROTO_CHROMIUM")
    if configured:
        return configured
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


class _DOM(html.parser.HTMLParser):
    """The bits of the rendered page the test reads."""

    def __init__(self):
        super().__init__()
        self.body = {}
        self.rows = {}          # ("log"|"server", name) -> [td data-value...]
        self.polylines = {}     # chart id -> [attrs]
        self._row = None
        self._chart = None
        self.accelerator = None     # the warning's attributes, and "text"
        self._in_accelerator = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id") == "accelerator":
            self.accelerator = dict(a, text="")
            self._in_accelerator = True
        if tag == "body":
            self.body = a
        elif tag == "tr":
            key = ("log", a["data-log"]) if "data-log" in a else (
                ("server", a["data-server"]) if "data-server" in a else None)
            self._row = key
            if key is not None:
                self.rows[key] = []
        elif tag == "td" and self._row is not None:
            self.rows[self._row].append(a.get("data-value"))
        elif tag == "svg":
            self._chart = a.get("id")
        elif tag == "polyline" and self._chart:
            self.polylines.setdefault(self._chart, []).append(a)

    def handle_data(self, data):
        if self._in_accelerator:
            self.accelerator["text"] += data

    def handle_endtag(self, tag):
        if tag == "p":
            self._in_accelerator = False
        if tag == "tr":
            self._row = None
        elif tag == "svg":
            self._chart = None


class BrowserTests(unittest.TestCase):
    """The page in a real headless browser, over a running Styx server's live metrics."""

    timeout = 180

    def setUp(self):
        self.browser = find_browser()
        if self.browser is None:
            missing("no headless browser (chromium) found: apt-get install chromium, or "
                    "set STREAMPROTO_CHROMIUM; .ci/run installs Debian's chromium as root")

    @defer.inlineCallbacks
    def dump_dom(self, url):
        profile = tempfile.mkdtemp(prefix="streamproto-chromium-")
        self.addCleanup(shutil.rmtree, profile, True)
        args = [self.browser, "--headless", "--no-sandbox", "--disable-gpu",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                f"--user-data-dir={profile}", "--virtual-time-budget=5000", "--dump-dom", url]
        env = dict(os.environ, HOME=profile, XDG_CONFIG_HOME=profile, XDG_CACHE_HOME=profile)
        proto = ProcessOutput(b"")
        process = reactor.spawnProcess(proto, self.browser, args, env=env)
        killer = reactor.callLater(120, lambda: process.signalProcess("KILL"))
        out, err, code = yield proto.ended
        if killer.active():
            killer.cancel()
        self.assertEqual(code, 0, err[-2000:])
        return out.decode("utf-8", "replace")

    @defer.inlineCallbacks
    def test_live_page(self):
        server = RunningService(styx_tap, ["--metrics", "tcp:0:interface=127.0.0.1"])
        api, metrics = yield server.start(self)
        client = StyxClient(f"http://127.0.0.1:{api}", reactor)
        self.addCleanup(client.close)
        yield client.create_log("pagetest")
        site = f"http://127.0.0.1:{metrics}"
        written = 0
        # a few samples with traffic between them: the charts have a past
        for batch in (100, 150, 250):
            yield client.write_records("pagetest", [b"r%d" % i for i in range(batch)])
            written += batch
            response = yield treq.get(site + "/status.json", persistent=False)
            yield response.content()
            yield task.deferLater(reactor, 1.1, lambda: None)

        dom = _DOM()
        dom.feed((yield self.dump_dom(site + "/")))
        self.assertEqual(dom.body.get("data-state"), "live", dom.body)
        self.assertGreaterEqual(int(dom.body.get("data-updates", 0)), 1)
        # the tables: numbers from the live store and counters
        log_row = dom.rows[("log", "pagetest")]
        self.assertEqual(float(log_row[1]), written)          # records
        self.assertEqual(float(log_row[2]), written)          # end position
        server_row = dom.rows[("server", "styx-server")]
        self.assertGreaterEqual(float(server_row[2]), 1)      # connections accepted
        # the charts: the styx server's input rate over the samples, not flat
        lines = {p["data-series"]: p for p in dom.polylines["chart-in"]}
        points = [tuple(map(float, xy.split(","))) for xy in
                  lines["styx-server"]["points"].split()]
        self.assertGreaterEqual(len(points), 2, points)
        self.assertGreater(len({y for _, y in points}), 1, points)
        logs = {p["data-series"] for p in dom.polylines["chart-logs"]}
        self.assertIn("pagetest", logs)
        # accelerated or not, the page says what the server's metric says
        self.assertEqual("hidden" not in dom.accelerator, not accelerator.accelerated(),
                         dom.accelerator)

    @defer.inlineCallbacks
    def test_pure_python_warning(self):
        """A server without its C accelerator: the page says so, with the cost."""
        self.patch(accelerator, "speedups", None)
        server = RunningService(styx_tap, ["--metrics", "tcp:0:interface=127.0.0.1"])
        _, metrics = yield server.start(self)
        dom = _DOM()
        dom.feed((yield self.dump_dom(f"http://127.0.0.1:{metrics}/")))
        self.assertEqual(dom.body.get("data-state"), "live", dom.body)
        self.assertNotIn("hidden", dom.accelerator)
        self.assertIn("without its C accelerator", dom.accelerator["text"])
        self.assertIn(accelerator.COST, dom.accelerator["text"])
