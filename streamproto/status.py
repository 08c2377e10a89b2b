"""
C{streamproto status [-s ADDRESS] [--once | -n N] [--interval S] [-f json]}:
a live summary of a running server from its metrics endpoint: connections,
rates per server and per log, store size per log, and a warning first when
the server runs without its C accelerator.  Refreshes in place on a
terminal; prints once otherwise.  The same summary
(L{streamproto.core.summary}) is the status page at C{/} of the metrics
site.
"""

import json
import ssl
import sys
import time
import urllib.request

from streamproto.core import accelerator
from streamproto.core import cli as common
from streamproto.core.summary import rates, summarise
from streamproto.log.public import is_internal

DEFAULT_URL = "http://127.0.0.1:9180/metrics"
PROG = "streamproto status"
CONVENTION = common.Convention(PROG, DEFAULT_URL, timeout=10.0,
                               timeout_help="seconds to wait for the metrics endpoint",
                               aliases=("--metrics",))


def scrape(url, timeout=5, context=None):
    with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
        return response.read().decode("utf-8")


def _ssl_context(args):
    """The TLS context of an https metrics endpoint (urllib: the ssl module's)."""
    if not args.server.tls:
        return None
    context = ssl.create_default_context(cafile=args.ca)
    if args.cert:
        context.load_cert_chain(args.cert, args.key)
    return context


def render(now, before=None, elapsed=None):
    """The summary as text; rates (per server and per log) when a previous one is given."""
    r = rates(now, before, elapsed)

    def rate(table, name, key, scale=1.0, fmt="{:,.0f}"):
        if r is None or name not in r[table]:
            return "-"
        return fmt.format(r[table][name][key] / scale)

    lines = []
    if now.get("accelerated") is False:
        lines.append(accelerator_warning())
    lines += [f"{'server':<24}{'open':>6}{'total':>8}{'in/s':>12}{'out/s':>12}"
             f"{'MB in/s':>10}{'errors':>8}"]
    for name, s in sorted(now["servers"].items()):
        lines.append(f"{name:<24}{s.get('open', 0):>6.0f}{s.get('connections', 0):>8.0f}"
                     f"{rate('servers', name, 'records_in'):>12}"
                     f"{rate('servers', name, 'records_out'):>12}"
                     f"{rate('servers', name, 'bytes_in', 1e6, '{:.2f}'):>10}"
                     f"{s.get('errors', 0):>8.0f}")
    if r is not None and r["fsync_ms"] is not None:
        lines.append(f"fsync: {r['fsync_ms']:.2f} ms mean over the last {elapsed:.1f} s")
    if now["logs"]:
        lines.append("")
        lines.append(f"{'log':<24}{'records':>14}{'end':>14}{'size MB':>12}{'in/s':>10}"
                     f"{'MB/s':>8}  status")
        internal = {}
        for name, log in sorted(now["logs"].items()):
            if is_internal(name):
                internal[name] = log    # the servers' own state: one line below
                continue
            status = "FAILED" if log.get("failed") else "ok"
            lines.append(f"{name:<24}{log.get('records', 0):>14,.0f}{log.get('end', 0):>14,.0f}"
                         f"{log.get('size', 0) / 1e6:>12.2f}"
                         f"{rate('logs', name, 'records'):>10}"
                         f"{rate('logs', name, 'bytes', 1e6, '{:.2f}'):>8}  {status}")
        if internal:
            label = f"(internal, {len(internal)} logs)"
            records = sum(log.get("records", 0) for log in internal.values())
            size = sum(log.get("size", 0) for log in internal.values())
            failed = sum(1 for log in internal.values() if log.get("failed"))
            status = f"FAILED ({failed})" if failed else "ok"
            lines.append(f"{label:<24}{records:>14,.0f}{'':>14}{size / 1e6:>12.2f}"
                         f"{'':>10}{'':>8}  {status}")
    return "\n".join(lines)


def accelerator_warning():
    """The line saying the server runs without its C accelerator, and what that costs."""
    return (f"WARNING: the server runs without its C accelerator (pure Python): "
            f"{accelerator.COST}")


def as_json(now, before=None, elapsed=None, when=None):
    """One refresh as a JSON document (C{-f json}): the summary and its rates."""
    public = {k: v for k, v in now["logs"].items() if not is_internal(k)}
    r = rates(now, before, elapsed)
    if r is not None:
        r["logs"] = {k: v for k, v in r["logs"].items() if not is_internal(k)}
    return json.dumps({"time": when, "servers": now["servers"], "logs": public,
                       "internal_logs": len(now["logs"]) - len(public), "rates": r,
                       "accelerated": now.get("accelerated")},
                      sort_keys=True)


def build_parser():
    p = CONVENTION.parser(
        "A live summary of a running server from its metrics endpoint: connections, "
        "rates per server and per log, store size per log.  Refreshes in place on a "
        "terminal; prints once otherwise.")
    p.add_argument("--once", action="store_true", help="print one summary and exit (-n 1)")
    p.add_argument("-n", "--count", type=common.positive_int, default=None,
                   help="print this many summaries, --interval apart, then exit "
                        "(default: for ever on a terminal, else 1)")
    p.add_argument("--interval", type=common.seconds, default=2.0,
                   help="refresh period in seconds (default 2)")
    return p


def main(argv=None, out=None):
    out = out or sys.stdout
    parser = build_parser()
    try:
        args = CONVENTION.parse(parser, argv)
        if args.server_name:
            # urllib verifies the name in the URL: put the certificate's name there
            parser.error("--server-name: give the name the certificate holds in -s/--server")
    except SystemExit as e:
        return e.code
    url = args.server.url("/metrics")
    count = 1 if args.once else args.count
    terminal = hasattr(out, "isatty") and out.isatty()
    if count is None:
        count = 0 if terminal else 1       # 0: for ever
    clear = terminal and args.format == "text" and count != 1
    try:
        context = _ssl_context(args)
        previous, taken, shown = None, None, 0
        while True:
            text = scrape(url, timeout=args.timeout or None, context=context)
            now_t = time.monotonic()
            summary = summarise(text)
            elapsed = (now_t - taken) if taken else None
            if args.format == "json":
                body = as_json(summary, previous, elapsed, time.time())
            else:
                body = render(summary, previous, elapsed)
            out.write(("\x1b[H\x1b[2J" if clear else "") + body + "\n")
            out.flush()
            shown += 1
            if count and shown >= count:
                return common.EXIT_OK
            previous, taken = summary, now_t
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return common.EXIT_OK
    except (OSError, ssl.SSLError) as e:
        return common.report(PROG, common.CommandError(f"cannot read {url}: {_reason(e)}"))
    except ValueError as e:
        # not a metrics endpoint (an HTML page, another service's port)
        return common.report(PROG, common.CommandError(
            f"{url} did not answer Prometheus metrics text: {e}"))


def _reason(error):
    """urllib's errors as one line (a URLError wraps the socket's or ssl's)."""
    reason = getattr(error, "reason", None)
    if reason is not None and not isinstance(reason, str):
        error = reason
    return common.error_text(error)
