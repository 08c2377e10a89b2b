"""
C{streamproto status [--metrics URL] [--once] [--interval S]}: a live summary
of a running server from its metrics endpoint: connections, rates, store
size per log.  Refreshes in place on a terminal; prints once otherwise.
"""

import argparse
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from streamproto.log.public import is_internal

DEFAULT_URL = "http://127.0.0.1:9180/metrics"


def scrape(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode("utf-8")


def summarise(text):
    """
    @return: {"servers": {name: {...}}, "logs": {name: {...}}} from the
        exposition text.
    """
    servers = {}
    logs = {}
    wanted = {
        "streamproto_connections_open": "open",
        "streamproto_connections_total": "connections",
        "streamproto_records_in_total": "records_in",
        "streamproto_records_out_total": "records_out",
        "streamproto_received_bytes_total": "bytes_in",
        "streamproto_sent_bytes_total": "bytes_out",
        "streamproto_acks_sent_total": "acks",
    }
    log_fields = {
        "streamproto_log_size_bytes": "size",
        "streamproto_log_records": "records",
        "streamproto_log_end_position": "end",
        "streamproto_log_failed": "failed",
    }
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted:
                servers.setdefault(s.labels.get("server", "?"), {})[wanted[s.name]] = s.value
            elif s.name == "streamproto_protocol_errors_total":
                entry = servers.setdefault(s.labels.get("server", "?"), {})
                entry["errors"] = entry.get("errors", 0) + s.value
            elif s.name in log_fields:
                logs.setdefault(s.labels.get("log", "?"), {})[log_fields[s.name]] = s.value
    return {"servers": servers, "logs": logs}


def render(now, before=None, elapsed=None):
    """The summary as text; rates when a previous summary is given."""
    lines = [f"{'server':<24}{'open':>6}{'total':>8}{'in/s':>12}{'out/s':>12}"
             f"{'MB in/s':>10}{'errors':>8}"]
    for name, s in sorted(now["servers"].items()):
        prev = (before or {}).get("servers", {}).get(name, {})

        def rate(key, s=s, prev=prev):
            if not elapsed or key not in prev:
                return "-"
            return f"{(s.get(key, 0) - prev[key]) / elapsed:,.0f}"

        mb = "-"
        if elapsed and "bytes_in" in prev:
            mb = f"{(s.get('bytes_in', 0) - prev['bytes_in']) / elapsed / 1e6:.2f}"
        lines.append(f"{name:<24}{s.get('open', 0):>6.0f}{s.get('connections', 0):>8.0f}"
                     f"{rate('records_in'):>12}{rate('records_out'):>12}{mb:>10}"
                     f"{s.get('errors', 0):>8.0f}")
    if now["logs"]:
        lines.append("")
        lines.append(f"{'log':<24}{'records':>14}{'end':>14}{'size MB':>12}  status")
        internal = {}
        for name, log in sorted(now["logs"].items()):
            if is_internal(name):
                internal[name] = log    # the servers' own state: one line below
                continue
            status = "FAILED" if log.get("failed") else "ok"
            lines.append(f"{name:<24}{log.get('records', 0):>14,.0f}{log.get('end', 0):>14,.0f}"
                         f"{log.get('size', 0) / 1e6:>12.2f}  {status}")
        if internal:
            label = f"(internal, {len(internal)} logs)"
            records = sum(log.get("records", 0) for log in internal.values())
            size = sum(log.get("size", 0) for log in internal.values())
            failed = sum(1 for log in internal.values() if log.get("failed"))
            status = f"FAILED ({failed})" if failed else "ok"
            lines.append(f"{label:<24}{records:>14,.0f}{'':>14}{size / 1e6:>12.2f}  {status}")
    return "\n".join(lines)


def main(argv=None, out=None):
    out = out or sys.stdout
    p = argparse.ArgumentParser(
        prog="streamproto status",
        description="A live summary of a running server from its metrics endpoint: "
                    "connections, rates, store size per log.  Refreshes in place on a "
                    "terminal; prints once otherwise.")
    p.add_argument("--metrics", default=DEFAULT_URL, help=f"metrics URL (default {DEFAULT_URL})")
    p.add_argument("--once", action="store_true", help="print one summary and exit")
    p.add_argument("--interval", type=float, default=2.0, help="refresh period in seconds")
    args = p.parse_args(argv)
    live = not args.once and hasattr(out, "isatty") and out.isatty()
    try:
        previous, taken = None, None
        while True:
            text = scrape(args.metrics)
            now_t = time.monotonic()
            summary = summarise(text)
            elapsed = (now_t - taken) if taken else None
            body = render(summary, previous, elapsed)
            if live:
                out.write("\x1b[H\x1b[2J" + body + "\n")
                out.flush()
            else:
                out.write(body + "\n")
            if not live:
                return 0
            previous, taken = summary, now_t
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    except OSError as e:
        sys.stderr.write(f"streamproto status: cannot read {args.metrics}: {e}\n")
        return 1
    except ValueError as e:
        # not a metrics endpoint (an HTML page, another service's port)
        sys.stderr.write(f"streamproto status: {args.metrics} did not answer Prometheus "
                         f"metrics text: {e}\n")
        return 1
