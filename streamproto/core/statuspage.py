"""
The status page at C{/} of the metrics site, and its data at
C{/status.json}: the summary C{streamproto status} prints (one reading of
the metrics, L{streamproto.core.summary}), with live charts of the last
minutes.

The page is one HTML document with its style and script inline and charts
drawn as SVG by that script: nothing is fetched from anywhere but the
server itself, so it works offline, behind a firewall, on a laptop on a
train.  Its Content-Security-Policy says so to the browser too (no other
origin may be contacted).

History costs nothing while nobody looks: a sample (one collection of the
registry) is taken when C{/status.json} is asked, at most once per
C{min_interval}, and chart points older than C{window} are dropped, so
memory is bounded by C{window / min_interval} points of at most
C{max_chart_logs} logs each.
"""

import json
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, cast

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import Metric
from twisted.internet.interfaces import IReactorTime
from twisted.web import resource
from twisted.web.server import Request

from streamproto.core import accelerator
from streamproto.core.clock import default_reactor
from streamproto.core.summary import SERVER_RATES, Summary, rates, summarise_families
from streamproto.log.public import is_internal

#: seconds of history the charts show
WINDOW = 300.0
#: at most one sample per this many seconds (however many pages are open)
MIN_INTERVAL = 1.0
#: logs charted (the busiest by end position); the table shows them all
MAX_CHART_LOGS = 8

_SECURITY_HEADERS = {
    # the page's own script and style, requests to this server only
    b"content-security-policy": b"default-src 'none'; script-src 'unsafe-inline'; "
                                b"style-src 'unsafe-inline'; connect-src 'self'; img-src data:; "
                                b"base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    b"x-content-type-options": b"nosniff",
    b"cache-control": b"no-store",
}


class StatusHistory:
    """
    Samples of the summary, taken on demand (see the module docstring).

    Each sample is reduced at once to a chart point (per-server rates, the
    busiest logs' append rates, fsync latency); only the last two whole
    summaries are kept (the tables' values and rates), so answering costs
    one collection and one summary however long the history.

    @param collect: returns the metric families to summarise (default:
        the global registry's, what C{/metrics} serves).
    @param clock: an C{IReactorTime} (its C{seconds()} are wall-clock
        seconds under a real reactor: the charts' time axis).
    """

    def __init__(self, clock: IReactorTime, collect: Callable[[], Iterable[Metric]] | None = None,
                 window: float = WINDOW, min_interval: float = MIN_INTERVAL,
                 max_chart_logs: int = MAX_CHART_LOGS) -> None:
        self.clock = clock
        self.collect = collect or REGISTRY.collect
        self.window = window
        self.min_interval = min_interval
        self.max_chart_logs = max_chart_logs
        self.samples: list[tuple[float, Summary]] = []  # the last two (time, summary)
        self.points: deque[dict[str, Any]] = deque()  # chart points, oldest first

    def sample(self) -> None:
        """Take a sample unless the last one is recent enough; drop old points."""
        now = self.clock.seconds()
        if not self.samples or now - self.samples[-1][0] >= self.min_interval:
            summary = summarise_families(self.collect())
            if self.samples:
                self._add_point(now, summary, *self.samples[-1])
            self.samples = self.samples[-1:] + [(now, summary)]
        cutoff = now - self.window
        while self.points and self.points[0]["t"] < cutoff:
            self.points.popleft()

    def _add_point(self, t: float, summary: Summary, before_t: float, before: Summary) -> None:
        r = rates(summary, before, t - before_t)
        if r is None:
            return
        logs = summary["logs"]
        busiest = sorted((k for k in logs if not is_internal(k) and k in r["logs"]),
                         key=lambda k: -logs[k].get("end", 0))[:self.max_chart_logs]
        self.points.append({
            "t": t,
            "servers": {name: dict(v, open=summary["servers"][name].get("open", 0))
                        for name, v in r["servers"].items()},
            "logs": {name: r["logs"][name]["records"] for name in busiest},
            "fsync_ms": r["fsync_ms"],
        })

    def snapshot(self) -> dict[str, Any]:
        """The document of C{/status.json} (after a L{sample})."""
        self.sample()
        t, now = self.samples[-1]
        before_t: float | None
        before: Summary | None
        before_t, before = self.samples[0] if len(self.samples) > 1 else (None, None)
        elapsed = t - before_t if before_t is not None else None
        public = {k: v for k, v in now["logs"].items() if not is_internal(k)}
        internal = [v for k, v in now["logs"].items() if is_internal(k)]
        current = rates(now, before, elapsed)
        if current is not None:
            current["logs"] = {k: v for k, v in current["logs"].items() if not is_internal(k)}
        return {
            "time": t,
            "interval": elapsed,
            "window": self.window,
            "servers": now["servers"],
            "logs": public,
            "internal_logs": {
                "count": len(internal),
                "records": sum(v.get("records", 0) for v in internal),
                "size": sum(v.get("size", 0) for v in internal),
                "failed": sum(1 for v in internal if v.get("failed")),
            },
            "rates": current,
            "history": list(self.points),
            "rate_keys": list(SERVER_RATES),
            # False: this server runs in pure Python (the page warns)
            "accelerated": now.get("accelerated"),
            "accelerator_cost": accelerator.COST,
        }


class StatusJSON(resource.Resource):
    """C{/status.json}: L{StatusHistory.snapshot}."""

    isLeaf = True

    def __init__(self, history: StatusHistory) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # untyped in Twisted
        self.history = history

    def render_GET(self, request: Request) -> bytes:
        for name, value in _SECURITY_HEADERS.items():
            request.setHeader(name, value)
        request.setHeader(b"content-type", b"application/json")
        return json.dumps(self.history.snapshot(), separators=(",", ":")).encode()


class StatusPage(resource.Resource):
    """C{/}: the page (static: everything it shows comes from C{status.json})."""

    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        for name, value in _SECURITY_HEADERS.items():
            request.setHeader(name, value)
        request.setHeader(b"content-type", b"text/html; charset=utf-8")
        return PAGE


def install_status_page(root: resource.Resource, clock: IReactorTime | None = None,
                        collect: Callable[[], Iterable[Metric]] | None = None) -> StatusHistory:
    """
    Serve the page at C{/} and its data at C{/status.json} under C{root}
    (the metrics site's root resource).  @return: the L{StatusHistory}.
    """
    clock = cast(IReactorTime, default_reactor(clock))
    history = StatusHistory(clock, collect)
    root.putChild(b"", StatusPage())  # type: ignore[no-untyped-call]  # untyped in Twisted
    root.putChild(b"status.json", StatusJSON(history))
    return history


PAGE = b"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>streamproto status</title>
<style>
 body { font: 14px/1.4 system-ui, sans-serif; margin: 1em 2em; color: #222; background: #fafafa; }
 h1 { font-size: 1.3em; margin: 0 0 .2em 0; }
 h2 { font-size: 1.05em; margin: 1.2em 0 .4em 0; }
 #banner { padding: .4em .8em; border-radius: 4px; display: inline-block; }
 #banner.ok { background: #e3f4e1; } #banner.bad { background: #fbe3e3; }
 #banner.wait { background: #eee; }
 .warn { background: #fff3cd; padding: .4em .8em; border-radius: 4px; }
 table { border-collapse: collapse; background: #fff; }
 th, td { padding: .25em .7em; border-bottom: 1px solid #e4e4e4; text-align: right; }
 th:first-child, td:first-child { text-align: left; }
 th { background: #f0f0f0; font-weight: 600; }
 td.failed { color: #b00; font-weight: 600; }
 .charts { display: flex; flex-wrap: wrap; gap: 1em; }
 figure { margin: 0; background: #fff; border: 1px solid #e4e4e4; padding: .4em; }
 figcaption { font-weight: 600; font-size: .95em; }
 svg text { font: 11px system-ui, sans-serif; fill: #555; }
 .legend span { display: inline-block; margin-right: .8em; font-size: .85em; }
 .legend i { display: inline-block; width: .8em; height: .8em; margin-right: .25em; }
 .muted { color: #777; font-size: .9em; }
</style>
</head>
<body data-state="loading" data-updates="0">
<h1>streamproto status</h1>
<div><span id="banner" class="wait">waiting for the first reading&hellip;</span>
 <span class="muted" id="updated"></span></div>
<p id="accelerator" class="warn" hidden></p>
<h2>Last minutes</h2>
<div class="charts">
 <figure><figcaption>records in / s</figcaption><svg id="chart-in" width="460" height="150"></svg><div class="legend" id="legend-in"></div></figure>
 <figure><figcaption>records out / s</figcaption><svg id="chart-out" width="460" height="150"></svg><div class="legend" id="legend-out"></div></figure>
 <figure><figcaption>connections open</figcaption><svg id="chart-open" width="460" height="150"></svg><div class="legend" id="legend-open"></div></figure>
 <figure><figcaption>appended records / s per log</figcaption><svg id="chart-logs" width="460" height="150"></svg><div class="legend" id="legend-logs"></div></figure>
 <figure><figcaption>fsync latency, mean ms</figcaption><svg id="chart-fsync" width="460" height="150"></svg><div class="legend" id="legend-fsync"></div></figure>
</div>
<h2>Servers</h2>
<table id="servers"><thead><tr><th>server</th><th>open</th><th>total</th><th>in/s</th>
<th>out/s</th><th>MB in/s</th><th>MB out/s</th><th>errors</th><th>back-pressure/s</th></tr></thead>
<tbody></tbody></table>
<h2>Logs</h2>
<table id="logs"><thead><tr><th>log</th><th>records</th><th>end</th><th>size MB</th>
<th>in/s</th><th>MB/s</th><th>status</th></tr></thead><tbody></tbody></table>
<p class="muted">The same numbers as <code>streamproto status</code>, from
<a href="metrics">/metrics</a>; readiness from <a href="ready">/ready</a>.
Refreshed every 2 s; nothing is loaded from anywhere but this server.</p>
<script>
"use strict";
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
const SVGNS = "http://www.w3.org/2000/svg";

function num(v, digits) {
  if (v === null || v === undefined || !isFinite(v)) return "-";
  const fixed = Number(v).toFixed(digits || 0);
  const parts = fixed.split(".");
  parts[0] = parts[0].replace(/\\B(?=(\\d{3})+(?!\\d))/g, ",");
  return parts.join(".");
}

function cell(row, value, digits, cls) {
  const td = document.createElement("td");
  td.textContent = typeof value === "string" ? value : num(value, digits);
  if (typeof value === "number") td.dataset.value = String(value);
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

// A rate in MB/s (none yet: no figure).
function megabytes(bytes) {
  return bytes === undefined ? null : bytes / 1e6;
}

// The table #id, emptied, then one row a name (sorted, marked data-<kind>
// for the tests): its name, then what fill(row, now, rates) adds from its
// current figures and its rates (empty before the second sample).
function fillTable(id, kind, now, rates, fill) {
  const body = document.querySelector("#" + id + " tbody");
  body.textContent = "";
  for (const name of Object.keys(now).sort()) {
    const row = body.insertRow();
    row.dataset[kind] = name;
    cell(row, name);
    fill(row, now[name], rates[name] || {});
  }
  return body;
}

function svg(tag, attrs, parent) {
  const e = document.createElementNS(SVGNS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(e);
  return e;
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

// series: [{name, points: [[t, v], ...]}]
function chart(id, series, end, window, digits) {
  const el = document.getElementById("chart-" + id);
  const legend = document.getElementById("legend-" + id);
  while (el.firstChild) el.removeChild(el.firstChild);
  legend.textContent = "";
  const W = 460, H = 150, L = 48, R = 8, T = 8, B = 20;
  const start = end - window;
  let vmax = 0;
  for (const s of series) for (const p of s.points) if (p[1] > vmax) vmax = p[1];
  vmax = niceMax(vmax);
  const x = t => L + (W - L - R) * (t - start) / window;
  const y = v => T + (H - T - B) * (1 - v / vmax);
  for (const f of [0, 0.5, 1]) {
    svg("line", {x1: L, x2: W - R, y1: y(f * vmax), y2: y(f * vmax), stroke: "#e4e4e4"}, el);
    svg("text", {x: L - 4, y: y(f * vmax) + 4, "text-anchor": "end"}, el).textContent =
      num(f * vmax, vmax < 10 ? 1 : 0);
  }
  svg("text", {x: L, y: H - 5}, el).textContent = "-" + Math.round(window / 60) + " min";
  svg("text", {x: W - R, y: H - 5, "text-anchor": "end"}, el).textContent = "now";
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const pts = s.points.filter(p => p[0] >= start && p[1] !== null && isFinite(p[1]));
    if (pts.length) {
      const line = svg("polyline", {fill: "none", stroke: color, "stroke-width": 1.6,
        points: pts.map(p => x(p[0]).toFixed(1) + "," + y(p[1]).toFixed(1)).join(" ")}, el);
      line.dataset.series = s.name;
      line.dataset.last = String(pts[pts.length - 1][1]);
    }
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = color;
    item.appendChild(swatch);
    item.appendChild(document.createTextNode(s.name));
    legend.appendChild(item);
  });
}

function perServer(history, key) {
  const names = new Set();
  for (const h of history) for (const n in h.servers) names.add(n);
  return [...names].sort().map(n => ({name: n, points: history.map(
    h => [h.t, h.servers[n] ? h.servers[n][key] : null])}));
}

function render(s) {
  const r = s.rates || {servers: {}, logs: {}};
  const accel = document.getElementById("accelerator");
  accel.hidden = s.accelerated !== false;
  accel.textContent = s.accelerated === false ?
    "This server runs without its C accelerator (pure Python): " + s.accelerator_cost + "." : "";
  fillTable("servers", "server", s.servers, r.servers, (row, v, rv) => {
    cell(row, v.open); cell(row, v.connections);
    cell(row, rv.records_in); cell(row, rv.records_out);
    cell(row, megabytes(rv.bytes_in), 2); cell(row, megabytes(rv.bytes_out), 2);
    cell(row, v.errors); cell(row, rv.pauses, 1);
  });
  const logs = fillTable("logs", "log", s.logs, r.logs, (row, v, rv) => {
    cell(row, v.records); cell(row, v.end); cell(row, v.size / 1e6, 2);
    cell(row, rv.records); cell(row, megabytes(rv.bytes), 2);
    if (v.failed) cell(row, "FAILED", 0, "failed"); else cell(row, "ok");
  });
  const internal = s.internal_logs;
  if (internal && internal.count) {
    const row = logs.insertRow();
    cell(row, "(internal, " + internal.count + " logs)");
    cell(row, internal.records); cell(row, ""); cell(row, internal.size / 1e6, 2);
    cell(row, ""); cell(row, "");
    if (internal.failed) cell(row, "FAILED (" + internal.failed + ")", 0, "failed");
    else cell(row, "ok");
  }
  const h = s.history;
  chart("in", perServer(h, "records_in"), s.time, s.window);
  chart("out", perServer(h, "records_out"), s.time, s.window);
  chart("open", perServer(h, "open"), s.time, s.window);
  const logNames = new Set();
  for (const e of h) for (const n in e.logs) logNames.add(n);
  chart("logs", [...logNames].sort().map(n => ({name: n, points: h.map(
    e => [e.t, n in e.logs ? e.logs[n] : null])})), s.time, s.window);
  chart("fsync", [{name: "fsync", points: h.map(e => [e.t, e.fsync_ms])}], s.time, s.window);
  document.getElementById("updated").textContent =
    "updated " + new Date(s.time * 1000).toLocaleTimeString() + ", " + h.length +
    " samples charted";
}

async function readiness() {
  const banner = document.getElementById("banner");
  try {
    const r = await fetch("ready", {cache: "no-store"});
    const body = await r.json();
    banner.className = body.ready ? "ok" : "bad";
    banner.textContent = body.ready ? "ready" :
      "not ready: " + (body.problems || []).join("; ");
  } catch (e) {
    banner.className = "bad";
    banner.textContent = "no answer from /ready";
  }
}

let updates = 0;
async function refresh() {
  try {
    const r = await fetch("status.json", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
    updates += 1;
    document.body.dataset.updates = String(updates);
    document.body.dataset.state = "live";
    await readiness();
  } catch (e) {
    document.body.dataset.state = "error";
    const banner = document.getElementById("banner");
    banner.className = "bad";
    banner.textContent = "cannot reach the server: " + e.message;
  }
  setTimeout(refresh, 2000);
}
refresh();
</script>
</body>
</html>
"""
