"""
doc/grafana/streamproto.json queries only metrics the servers export: every
series name in every panel's PromQL is read off a running Styx server's two
C{/metrics} pages (the metrics site and the Styx API port), whose
exposition lists every family, fed or not, with its type.
"""

import json
import os
import re

import treq
from twisted.internet import defer
from twisted.trial import unittest

from streamproto.styx import tap as styx_tap
from test.support.test_ops_support import RunningService

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASHBOARD = os.path.join(ROOT, "doc", "grafana", "streamproto.json")

#: PromQL words that are not series names
PROMQL_WORDS = frozenset({
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "deriv", "delta",
    "histogram_quantile", "topk", "bottomk", "by", "without", "on", "ignoring", "and", "or",
    "unless", "bool", "offset", "label_values", "abs", "clamp_min", "clamp_max",
})

#: the samples a family of each type has in the text exposition
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "untyped": ("",),
}


def series_names(expr):
    """The series names a PromQL expression reads (label matchers, groupings, ranges out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
    words = re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr)
    return {w for w in words if w not in PROMQL_WORDS}


def exported_names(text):
    """Every sample name of an exposition, from its C{# TYPE} lines."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(None, 3)
            base = family[:-len("_total")] if kind == "counter" and family.endswith(
                "_total") else family
            names.update(base + s for s in SUFFIXES[kind.strip()])
    return names


def panels(dashboard):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", ())


def dashboard_exprs(dashboard):
    """(panel title, expr) of every query, template variables included."""
    for panel in panels(dashboard):
        for target in panel.get("targets", ()):
            yield panel["title"], target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            yield f"${variable['name']}", re.sub(r"^label_values\((\w+),.*\)$", r"\1", query)


class DashboardModel(unittest.SynchronousTestCase):
    def setUp(self):
        with open(DASHBOARD) as f:
            self.dashboard = json.load(f)

    def test_well_formed(self):
        ids = [p["id"] for p in panels(self.dashboard)]
        self.assertEqual(len(ids), len(set(ids)))
        names = [v["name"] for v in self.dashboard["templating"]["list"]]
        self.assertEqual(names, ["datasource", "server", "log"])
        for panel in panels(self.dashboard):
            if panel["type"] == "row":
                continue
            self.assertEqual(panel["datasource"]["uid"], "${datasource}", panel["title"])
            self.assertTrue(panel["targets"], panel["title"])
            for target in panel["targets"]:
                self.assertEqual(target["datasource"]["uid"], "${datasource}")

    def test_covers_the_operators_questions(self):
        """Rates in and out per server, connections, fsync latency, size per log, errors,
        back-pressure."""
        used = set()
        for _, expr in dashboard_exprs(self.dashboard):
            used |= series_names(expr)
        for name in ("streamproto_records_in_total", "streamproto_records_out_total",
                     "streamproto_connections_open", "streamproto_fsync_seconds_bucket",
                     "streamproto_log_size_bytes", "streamproto_protocol_errors_total",
                     "streamproto_backpressure_pauses_total"):
            self.assertIn(name, used)

    def test_series_names(self):
        self.assertEqual(series_names(
            'histogram_quantile(0.99, sum by (le) (rate(streamproto_fsync_seconds_bucket'
            '[$__rate_interval])))'), {"streamproto_fsync_seconds_bucket"})
        self.assertEqual(series_names('-sum by (server) (rate(x_total{server=~"$server"}[5m]))'
                                      ' / sum(rate(y_count[1m]))'), {"x_total", "y_count"})

    def test_exported_names(self):
        text = ("# HELP a_total A.\n# TYPE a_total counter\n# TYPE b gauge\nb 1\n"
                "# TYPE c histogram\n")
        self.assertEqual(exported_names(text),
                         {"a_total", "a_created", "b", "c_bucket", "c_count", "c_sum",
                          "c_created"})


class DashboardAgainstServers(unittest.TestCase):
    timeout = 60

    @defer.inlineCallbacks
    def scrape(self, url):
        response = yield treq.get(url, persistent=False)
        self.assertEqual(response.code, 200, url)
        return (yield response.text())

    @defer.inlineCallbacks
    def test_every_queried_series_is_exported(self):
        server = RunningService(styx_tap, ["--metrics", "tcp:0:interface=127.0.0.1"])
        api, metrics = yield server.start(self)
        exported = set()
        for port in (api, metrics):
            exported |= exported_names((yield self.scrape(f"http://127.0.0.1:{port}/metrics")))
        self.assertIn("streamproto_records_in_total", exported)   # the scrape is real
        with open(DASHBOARD) as f:
            dashboard = json.load(f)
        unknown = {}
        for title, expr in dashboard_exprs(dashboard):
            missing = series_names(expr) - exported
            if missing:
                unknown[title] = sorted(missing)
        self.assertEqual(unknown, {}, "series the servers do not export")

    def test_a_misspelled_series_is_caught(self):
        exported = exported_names("# TYPE streamproto_records_in counter\n")
        self.assertEqual(series_names("rate(streamproto_record_in_total[1m])") - exported,
                         {"streamproto_record_in_total"})
