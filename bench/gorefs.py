"""
Running the Go reference programs next to our servers, for the benchmarks
that compare with them (C{styx_bench.py --go-styx}, C{lumberjack_bench.py
--go-send}).  The Go programs are built by whoever runs the benchmark,
outside this repository (which keeps none of their code or build recipes);
this module only starts them, and our servers, on 127.0.0.1.
"""

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


def twistd(plugin, *args, log=None):
    """Start C{twistd -n PLUGIN ARGS} from this checkout (our plugins found
    through PYTHONPATH)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, "-m", "twisted.scripts.twistd", "-n", "--pidfile=", plugin, *args],
        env=env, cwd=ROOT, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT)


def stop(proc):
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- styx ------------------------------------------------------------------

def go_styx_server(binary, port, directory):
    """The reference styx-server on 127.0.0.1:PORT with its data in DIRECTORY."""
    config = os.path.join(directory, "config.toml")
    with open(config, "w") as f:
        f.write(f'bind_address = "127.0.0.1:{port}"\n'
                f'pid_file = "{directory}/styx.pid"\n'
                "[log_manager]\n"
                f'data_directory = "{directory}/data"\n')
    os.makedirs(os.path.join(directory, "data"), exist_ok=True)
    proc = subprocess.Popen([binary, "--config", config], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, cwd=directory)
    wait_port(port)
    return proc


_PHASE = re.compile(rb"benchmarking (PRODUCE|CONSUME) with (\d+) records of size (\d+)")
_RATE = re.compile(rb"(\d+) records in ([\d.]+) seconds \(([\d.]+) records/s")


def styx_benchmark(styx_cli, url, timeout=1800):
    """
    Run the reference's unchanged C{styx benchmark -H URL}; return
    {(phase, size): records/s} from the last progress line of each phase
    (its produce figures stop the clock at the last write, before the acks).
    """
    out = subprocess.run([styx_cli, "benchmark", "-H", url], capture_output=True,
                         timeout=timeout).stdout.replace(b"\r", b"\n")
    rates, phase = {}, None
    for line in out.split(b"\n"):
        m = _PHASE.search(line)
        if m:
            phase = (m.group(1).decode().lower(), int(m.group(3)))
            continue
        m = _RATE.search(line)
        if m and phase is not None:
            rates[phase] = float(m.group(3))
    return rates


def compare_styx(styx_cli, go_server, rounds=3, warmup=True):
    """
    Alternate the reference's C{styx benchmark} between the Go server and
    C{twistd styx-server} (file store, durable acks) ROUNDS times; return
    {(phase, size): (go median, ours median, go runs, our runs)}.
    """
    tmp = tempfile.mkdtemp(prefix="styx-go-compare-")
    go_port, our_port = free_port(), free_port()
    go = ours = None
    try:
        go = go_styx_server(go_server, go_port, os.path.join(tmp, "go"))
        ours = twistd("styx-server", "--port", f"tcp:{our_port}:interface=127.0.0.1",
                      "--data", os.path.join(tmp, "ours"))
        wait_port(our_port)
        urls = {"go": f"http://127.0.0.1:{go_port}", "ours": f"http://127.0.0.1:{our_port}"}
        if warmup:
            for url in urls.values():
                styx_benchmark(styx_cli, url)
        runs = {"go": [], "ours": []}
        for _ in range(rounds):
            for side, url in urls.items():
                runs[side].append(styx_benchmark(styx_cli, url))
        table = {}
        for key in runs["go"][0]:
            g = [r[key] for r in runs["go"] if key in r]
            o = [r[key] for r in runs["ours"] if key in r]
            if g and o:
                table[key] = (statistics.median(g), statistics.median(o), g, o)
        return table
    finally:
        stop(go)
        stop(ours)
        subprocess.run(["rm", "-rf", tmp])


# -- lumberjack ----------------------------------------------------------

def _acked(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/vars", timeout=10) as r:
        return json.load(r)["ACKed"]


def tst_send_rate(tst_send, port, seconds, pipeline=0):
    """Events/s go-lumber's C{tst-send} gets acked by the server on PORT,
    measured over SECONDS after a two-second start (from its expvar count)."""
    vars_port = free_port()
    proc = subprocess.Popen([tst_send, "-c", f"127.0.0.1:{port}",
                             "-httpprof", f"127.0.0.1:{vars_port}",
                             "-pipeline", str(pipeline)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_port(vars_port)
        time.sleep(2)
        t0, a0 = time.monotonic(), _acked(vars_port)
        time.sleep(seconds)
        t1, a1 = time.monotonic(), _acked(vars_port)
        return (a1 - a0) / (t1 - t0)
    finally:
        stop(proc)


def compare_lumberjack(tst_send, tst_lj, seconds=8, rounds=3, pipeline=0):
    """
    Alternate C{tst-send} between go-lumber's C{tst-lj -v2} (acks without
    storing) and C{twistd lumberjack-server} (file store, acks after
    fsync); return (go median, ours median, go runs, our runs).
    """
    tmp = tempfile.mkdtemp(prefix="lumberjack-go-compare-")
    go_port, our_port = free_port(), free_port()
    go = ours = None
    try:
        go = subprocess.Popen([tst_lj, "-bind", f"127.0.0.1:{go_port}", "-v2"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        ours = twistd("lumberjack-server", "--port", f"tcp:{our_port}:interface=127.0.0.1",
                      "--data", os.path.join(tmp, "ours"))
        wait_port(go_port)
        wait_port(our_port)
        g, o = [], []
        for _ in range(rounds):
            g.append(tst_send_rate(tst_send, go_port, seconds, pipeline))
            o.append(tst_send_rate(tst_send, our_port, seconds, pipeline))
        return statistics.median(g), statistics.median(o), g, o
    finally:
        stop(go)
        stop(ours)
        subprocess.run(["rm", "-rf", tmp])
