"""
One-record Styx HTTP produce requests measured the way a user measures an
HTTP server: with C{wrk} (Debian's package: C{apt-get install wrk}),
keep-alive HTTP/1.1 connections, one request in flight each (not
pipelined), each answered once its record is durable.

    python bench/http_wrk.py --go-server /path/to/styx-server
    python bench/http_wrk.py --go-server PATH --baseline ../old-checkout \\
        --connections 8,64 --rounds 3 --seconds 8 --size 100

Ours (C{twistd styx-server} from this checkout, file store), and with
C{--baseline} another checkout's, and with C{--go-server} the reference,
run at once on 127.0.0.1; each round runs C{wrk} against each in turn for
C{--seconds}, so that the machine's other load hits them alike.  Printed:
every run's requests a second and wrk's own p50 / p99 (wrk corrects
neither for coordinated omission nor for its own lateness: a closed loop
of C{--connections} requests), then the medians and ours over each other.

The Go reference is built outside this repository; wrk is not ours
either: both are only run.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.benchenv import measured  # noqa: E402
measured()   # which streamproto and path this measures (bench/benchenv.py)

from bench import gorefs  # noqa: E402

_RATE = re.compile(r"Requests/sec:\s+([\d.]+)")
_PERCENTILE = re.compile(r"^\s+(50|99)(?:\.0+)?%\s+([\d.]+)(us|ms|s)\s*$", re.M)
_NON_2XX = re.compile(r"Non-2xx or 3xx responses: (\d+)")
_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def parse_wrk(output):
    """(requests a second, p50 ms, p99 ms, non-2xx answers) from wrk's output."""
    rate = _RATE.search(output)
    if rate is None:
        raise RuntimeError(f"wrk printed no rate:\n{output}")
    percentiles = {int(p): float(v) * _UNITS[unit]
                   for p, v, unit in _PERCENTILE.findall(output)}
    bad = _NON_2XX.search(output)
    return (float(rate.group(1)), percentiles.get(50), percentiles.get(99),
            int(bad.group(1)) if bad else 0)


def run_wrk(port, connections, seconds, script):
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", script,
         f"http://127.0.0.1:{port}/logs/bench/records"],
        capture_output=True, text=True, timeout=seconds + 60, check=True)
    return parse_wrk(out.stdout)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--go-server", metavar="PATH", help="the reference styx-server")
    p.add_argument("--baseline", metavar="CHECKOUT",
                   help="another checkout of streamproto (accelerator built)")
    p.add_argument("--connections", default="8,64",
                   help="comma-separated connection counts (8,64)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=int, default=8)
    p.add_argument("--size", type=int, default=100, help="bytes a record (100)")
    args = p.parse_args(argv)
    try:
        connections = [int(c) for c in args.connections.split(",")]
    except ValueError:
        p.error("--connections: comma-separated integers")
    if shutil.which("wrk") is None:
        p.error("wrk is not installed (apt-get install wrk)")
    if args.go_server and not os.access(args.go_server, os.X_OK):
        p.error(f"--go-server: {args.go_server} is not an executable")

    directory = tempfile.mkdtemp(prefix="http-wrk-")
    script = os.path.join(directory, "post.lua")
    with open(script, "w") as f:
        f.write('wrk.method = "POST"\n'
                f'wrk.body = string.rep("x", {args.size})\n'
                'wrk.headers["Content-Type"] = "application/octet-stream"\n')
    servers, procs = [], []
    try:
        for name, root in [("ours", gorefs.ROOT)] + (
                [("before", os.path.abspath(args.baseline))] if args.baseline else []):
            port = gorefs.free_port()
            log = open(os.path.join(directory, f"{name}.log"), "wb")
            procs.append(gorefs.twistd(
                "styx-server", "--data", os.path.join(directory, name),
                "--port", f"tcp:{port}:interface=127.0.0.1", log=log, root=root))
            gorefs.wait_port(port)
            servers.append((name, port))
        if args.go_server:
            port = gorefs.free_port()
            procs.append(gorefs.go_styx_server(args.go_server, port,
                                               os.path.join(directory, "go")))
            servers.append(("Go", port))
        for _, port in servers:
            gorefs._create_log(port, "bench")

        print(f"wrk, {args.size} B records, {args.seconds} s a run, "
              f"servers in turn each round", flush=True)
        for n in connections:
            rates = {name: [] for name, _ in servers}
            for r in range(1, args.rounds + 1):
                for name, port in servers:
                    rate, p50, p99, bad = run_wrk(port, n, args.seconds, script)
                    if bad:
                        raise RuntimeError(f"{name}: {bad} answers were not 2xx")
                    rates[name].append(rate)
                    print(f"  {n} connections, round {r}, {name:6}: {rate:10,.0f} req/s"
                          f"  p50 {p50:.2f} ms  p99 {p99:.2f} ms", flush=True)
            medians = {name: statistics.median(v) for name, v in rates.items()}
            line = ", ".join(f"{name} {m:,.0f}" for name, m in medians.items())
            ratios = ", ".join(f"ours/{name} {medians['ours'] / m:.2f}"
                               for name, m in medians.items() if name != "ours")
            print(f"{n} connections, medians: {line}" + (f"; {ratios}" if ratios else ""),
                  flush=True)
    finally:
        for proc in procs:
            gorefs.stop(proc)
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
