"""
Running the Go reference programs next to our servers, for the benchmarks
that compare with them (C{styx_bench.py --go-styx}, C{lumberjack_bench.py
--go-send}).  The Go programs are built by whoever runs the benchmark,
outside this repository (which keeps none of their code or build recipes);
this module only starts them, and our servers, on 127.0.0.1.
"""

import contextlib
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


def pinned(cpu):
    """The command prefix running a program (every thread) on CPU C{cpu}
    only, or nothing for C{None}."""
    return [] if cpu is None else ["taskset", "-c", str(cpu)]


def twistd(plugin, *args, log=None, cpu=None, root=ROOT):
    """Start C{twistd -n PLUGIN ARGS} from this checkout (or the one at
    C{root}; our plugins found through PYTHONPATH), on CPU C{cpu} only if
    given."""
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [*pinned(cpu), sys.executable, "-c", "from twisted.scripts.twistd import run; run()",
         "-n", "--pidfile=", plugin, *args],
        env=env, cwd=root, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT)


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
    os.makedirs(directory, exist_ok=True)
    config = os.path.join(directory, "config.toml")
    with open(config, "w") as f:
        # the reference's documented settings, at its defaults but the
        # address and the directories
        f.write(f'bind_address = "127.0.0.1:{port}"\n'
                f'pid_file = "{directory}/styx.pid"\n'
                "shutdown_timeout = 3\n"
                'cors_allowed_origins = ["*"]\n'
                "http_read_buffer_size = 1048576\n"
                "http_write_buffer_size = 1048576\n"
                "tcp_read_buffer_size = 1048576\n"
                "tcp_write_buffer_size = 1048576\n"
                "tcp_timeout = 30\n"
                "websocket_read_buffer_size = 1048576\n"
                "websocket_write_buffer_size = 1048576\n"
                "[log_manager]\n"
                f'data_directory = "{directory}/data"\n'
                "read_buffer_size = 1048576\n"
                "write_buffer_size = 1048576\n")
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
    with styx_servers(go_server, "styx-go-compare-") as ports:
        urls = {side: f"http://127.0.0.1:{port}" for side, port in ports.items()}
        if warmup:
            for url in urls.values():
                styx_benchmark(styx_cli, url)
        runs = {"go": [], "ours": []}
        for _ in range(rounds):
            for side, url in urls.items():
                runs[side].append(styx_benchmark(styx_cli, url))
        # a run that failed a phase (the Go client against the Go server
        # now and then: "tcp: unknown message type", the race on the bytes
        # behind the 101) has no figure for it nor for the phases after it
        table = {}
        keys = dict.fromkeys(k for side in runs.values() for r in side for k in r)
        for key in keys:
            g = [r[key] for r in runs["go"] if key in r]
            o = [r[key] for r in runs["ours"] if key in r]
            if g and o:
                table[key] = (statistics.median(g), statistics.median(o), g, o)
        return table


def plain_styx(styx_cli, go_server, rounds=3, baseline=None):
    """
    The reference's C{styx benchmark} as a user runs it: one server at a
    time (the Go server, then C{twistd styx-server}, alternately, ROUNDS
    times), each on a fresh data directory and stopped after its run, no
    warm-up.  With C{baseline}, another checkout's C{twistd styx-server}
    takes a turn too (before/after a change, in one run).  Returns
    {side: [{(phase, size): records/s} per run]}, sides "go", "ours" and
    "baseline".
    """
    roots = {"go": None, "ours": ROOT}
    if baseline:
        roots["baseline"] = os.path.abspath(baseline)
    runs = {side: [] for side in roots}
    for _ in range(rounds):
        for side, root in roots.items():
            with styx_servers(go_server, "styx-go-plain-", sides=("go" if root is None else "ours",),
                              root=root or ROOT) as ports:
                port = next(iter(ports.values()))
                runs[side].append(styx_benchmark(styx_cli, f"http://127.0.0.1:{port}"))
    return runs


@contextlib.contextmanager
def styx_servers(go_server, prefix, pids=None, sides=("go", "ours"), root=ROOT):
    """
    The Go server and C{twistd styx-server} (file store) on fresh data
    directories, for the time of a C{with}: yields {"go": port, "ours": port}
    (and fills C{pids}, if given, with their process ids).  C{sides}: which
    of the two to start; C{root}: the checkout ours runs from.
    """
    tmp = tempfile.mkdtemp(prefix=prefix)
    ports = {side: free_port() for side in sides}
    go = ours = None
    try:
        if "go" in ports:
            go = go_styx_server(go_server, ports["go"], os.path.join(tmp, "go"))
        if "ours" in ports:
            ours = twistd("styx-server", "--port", f"tcp:{ports['ours']}:interface=127.0.0.1",
                          "--data", os.path.join(tmp, "ours"), root=root)
            wait_port(ports["ours"])
        if pids is not None:
            pids.update({side: proc.pid for side, proc in (("go", go), ("ours", ours))
                         if proc is not None})
        yield ports
    finally:
        stop(go)
        stop(ours)
        subprocess.run(["rm", "-rf", tmp])


def compare_long_read(styx_cli, go_server, gigabytes=1, rounds=5, size=1000):
    """
    A read long enough to measure steadily (the reference benchmark's 1000 B
    consume phase lasts some 40 ms): GIGABYTES of SIZE-byte records written
    to each server with the reference CLI (C{styx logs write}, lines), then
    read back whole with C{styx logs read --binary} to /dev/null, alternately,
    ROUNDS times.  Returns {"go"|"ours": [(seconds, server CPU seconds)]}
    (a read the Go server fails, its race on the bytes behind the 101, is
    left out).
    """
    count = int(gigabytes * 1e9) // size
    line = b"x" * (size - 1) + b"\n"
    pids = {}
    with styx_servers(go_server, "styx-go-read-", pids) as ports:
        urls = {side: f"http://127.0.0.1:{port}" for side, port in ports.items()}
        with tempfile.TemporaryFile() as lines:
            block = line * 1000
            for _ in range(count // 1000):
                lines.write(block)
            lines.write(line * (count % 1000))
            for url in urls.values():
                subprocess.run([styx_cli, "logs", "create", "long", "-H", url], check=True,
                               stdout=subprocess.DEVNULL)
                lines.seek(0)
                subprocess.run([styx_cli, "logs", "write", "long", "-H", url], check=True,
                               stdin=lines)
        runs = {"go": [], "ours": []}
        for _ in range(rounds):
            for side, url in urls.items():
                c0, t0 = cpu_seconds(pids[side]), time.perf_counter()
                done = subprocess.run([styx_cli, "logs", "read", "long", "--binary", "-H", url],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                t1, c1 = time.perf_counter(), cpu_seconds(pids[side])
                if done.returncode == 0:
                    runs[side].append((t1 - t0, c1 - c0))
        return runs


# -- lumberjack ----------------------------------------------------------

def _acked(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/vars", timeout=10) as r:
        return json.load(r)["ACKed"]


def cpu_seconds(pid):
    """User + system CPU seconds of process PID so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class SendRun:
    """
    One measured run of C{tst-send} (one or more at once): events acked per
    second (the sum of their C{ACKed} counters, the figure a user reads at
    C{http://ADDRESS/debug/vars}), and per CPU-second of each side.
    """

    def __init__(self, acked, server_cpu, sender_cpu, seconds, senders=1, log=()):
        self.acked = acked
        self.seconds = seconds
        self.senders = senders
        self.rate = acked / seconds
        self.server_cpu = server_cpu
        #: events acked per CPU-second the server spent
        self.server_efficiency = acked / server_cpu if server_cpu else float("inf")
        #: cores the senders (tst-send) used: near 1.0 on a core of their
        #: own, they are the bottleneck
        self.sender_load = sender_cpu / seconds
        #: what the senders printed besides their start-up lines (errors)
        self.log = list(log)

    def __repr__(self):
        return (f"{self.rate:,.0f}/s (server {self.server_efficiency:,.0f}/cpu-s, "
                f"senders {self.sender_load:.0%})")


#: what tst-send prints when it starts: anything else is an error it met
_STARTUP = re.compile(r"(Listening: |connect to: )")


def tst_send_command(tst_send, port, vars_port, pipeline=0):
    """The command line of one C{tst-send} against 127.0.0.1:PORT, its
    expvar page on VARS_PORT (C{-httpprof})."""
    return [tst_send, "-c", f"127.0.0.1:{port}", "-httpprof", f"127.0.0.1:{vars_port}",
            "-pipeline", str(pipeline)]


def tst_send_rate(tst_send, port, seconds, pipeline=0, server_pid=None, cpu=None, senders=1):
    """
    SENDERS of go-lumber's C{tst-send} at once against the server on PORT,
    measured over SECONDS after a two-second start: the sum of their expvar
    counts of acked events (C{ACKed} at C{/debug/vars}, what a user running
    C{tst-send} by hand reads), and the CPU the server and they used
    meanwhile, from /proc: a L{SendRun}.
    """
    procs, vars_ports = [], []
    try:
        for _ in range(senders):
            vars_ports.append(free_port())
            procs.append(subprocess.Popen(
                [*pinned(cpu), *tst_send_command(tst_send, port, vars_ports[-1], pipeline)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        for vars_port in vars_ports:
            wait_port(vars_port)
        time.sleep(2)
        s0 = cpu_seconds(server_pid) if server_pid else 0.0
        c0 = sum(cpu_seconds(p.pid) for p in procs)
        t0, a0 = time.monotonic(), sum(_acked(v) for v in vars_ports)
        time.sleep(seconds)
        t1, a1 = time.monotonic(), sum(_acked(v) for v in vars_ports)
        s1 = cpu_seconds(server_pid) if server_pid else 0.0
        c1 = sum(cpu_seconds(p.pid) for p in procs)
    finally:
        for proc in procs:
            stop(proc)
    log = [line.rstrip() for proc in procs for line in proc.stderr
           if line.strip() and not _STARTUP.search(line)]
    for proc in procs:
        proc.stderr.close()
    return SendRun(a1 - a0, s1 - s0, c1 - c0, t1 - t0, senders, log)


def lumberjack_commands(tst_send, tst_lj, pipeline=0, pin=False):
    """The commands L{compare_lumberjack} runs, as a user would type them."""
    server, sender = ("taskset -c 1 ", "taskset -c 0 ") if pin else ("", "")
    return [f"{server}{tst_lj} -bind 127.0.0.1:PORT -v2",
            f"{server}twistd -n lumberjack-server --port tcp:PORT:interface=127.0.0.1 "
            "--data DIR",
            f"{sender}{' '.join(tst_send_command(tst_send, 'PORT', 'VARSPORT', pipeline))}"
            "   (then ACKed at http://127.0.0.1:VARSPORT/debug/vars)"]


def compare_lumberjack(tst_send, tst_lj, seconds=8, rounds=3, pipeline=0, pin=False,
                       senders=1):
    """
    Alternate C{tst-send} (SENDERS of them at once) between go-lumber's
    C{tst-lj -v2} (acks without storing) and C{twistd lumberjack-server}
    (file store, acks after fsync); return (go runs, our runs), lists of
    L{SendRun}.

    @param pin: run each server on CPU 1 only and the senders on CPU 0
        only: each side gets one core of its own, and the servers the same.
    """
    tmp = tempfile.mkdtemp(prefix="lumberjack-go-compare-")
    go_port, our_port = free_port(), free_port()
    server_cpu, sender_cpu = (1, 0) if pin else (None, None)
    go = ours = None
    try:
        go = subprocess.Popen([*pinned(server_cpu), tst_lj, "-bind", f"127.0.0.1:{go_port}",
                               "-v2"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        ours = twistd("lumberjack-server", "--port", f"tcp:{our_port}:interface=127.0.0.1",
                      "--data", os.path.join(tmp, "ours"), cpu=server_cpu)
        wait_port(go_port)
        wait_port(our_port)
        g, o = [], []
        for _ in range(rounds):
            g.append(tst_send_rate(tst_send, go_port, seconds, pipeline, go.pid, sender_cpu,
                                   senders))
            o.append(tst_send_rate(tst_send, our_port, seconds, pipeline, ours.pid,
                                   sender_cpu, senders))
        return g, o
    finally:
        stop(go)
        stop(ours)
        subprocess.run(["rm", "-rf", tmp])


# -- raw clients: the same bytes to either server ----------------------------

def _create_log(port, name):
    base = f"http://127.0.0.1:{port}"
    try:
        urllib.request.urlopen(urllib.request.Request(f"{base}/logs/{name}", method="DELETE"))
    except OSError:
        pass
    urllib.request.urlopen(urllib.request.Request(
        f"{base}/logs", data=f"name={name}".encode(), method="POST",
        headers={"content-type": "application/x-www-form-urlencoded"}))


def _request(port, head):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(head)
    return s


def _read_head(s):
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(1)
        if not chunk:
            raise RuntimeError(f"connection closed in the response head: {head!r}")
        head += chunk
    return head


def _drain(s, want=None):
    buf, total = bytearray(1 << 20), 0
    while want is None or total < want:
        n = s.recv_into(buf)
        if not n:
            break
        total += n
    return total


def _records(size, count, header):
    """Chunks of COUNT records of SIZE bytes, each after its HEADER bytes."""
    record = header + bytes(size)
    per = max(1, (1 << 20) // len(record))
    chunk = record * per
    sent = 0
    while sent < count:
        k = min(per, count - sent)
        yield chunk if k == per else record * k
        sent += k


def styx0(port, mode, size, count, name="raw"):
    """
    Seconds to produce COUNT records of SIZE bytes over styx/0 until the
    final Ack (every record durable on both servers), or to consume them.
    """
    import struct
    if mode == "produce":
        _create_log(port, name)
    method, query = ("POST", "") if mode == "produce" else ("GET", f"?whence=origin&count={count}")
    s = _request(port, f"{method} /logs/{name}/records{query} HTTP/1.1\r\nHost: bench\r\n"
                       "Connection: upgrade\r\nUpgrade: styx/0\r\nX-Styx-Timeout: 30\r\n\r\n"
                       .encode())
    t = time.perf_counter()
    try:
        if b" 101 " not in _read_head(s).split(b"\r\n", 1)[0]:
            raise RuntimeError("no 101")
        if mode == "produce":
            for chunk in _records(size, count, struct.pack(">hi", 1, size)):
                s.sendall(chunk)
            s.shutdown(socket.SHUT_WR)
            _drain(s)               # acks, the last one after the last fsync
        else:
            got = _drain(s, count * (size + 6))
            if got < count * (size + 6):
                raise RuntimeError(f"consumed {got} bytes of {count * (size + 6)}")
        return time.perf_counter() - t
    finally:
        s.close()


BINARY = "application/vnd.styx.binary-records"


def http(port, mode, size, count, name="rawhttp"):
    """Seconds to produce COUNT records of SIZE bytes in one binary-records
    request (answered once all are durable), or to read them back in one
    response."""
    import struct
    if mode == "produce":
        _create_log(port, name)
        length = count * (size + 4)
        s = _request(port, f"POST /logs/{name}/records HTTP/1.1\r\nHost: bench\r\n"
                           f"Content-Type: {BINARY}\r\nContent-Length: {length}\r\n"
                           "Connection: close\r\n\r\n".encode())
        t = time.perf_counter()
        for chunk in _records(size, count, struct.pack(">i", size)):
            s.sendall(chunk)
        status = _read_head(s).split(b"\r\n", 1)[0]
        _drain(s)
    else:
        s = _request(port, f"GET /logs/{name}/records?whence=origin&count={count} HTTP/1.1\r\n"
                           f"Host: bench\r\nAccept: {BINARY}\r\nConnection: close\r\n\r\n"
                           .encode())
        t = time.perf_counter()
        status = _read_head(s).split(b"\r\n", 1)[0]
        got = _drain(s)
        if got < count * (size + 4):
            raise RuntimeError(f"read {got} bytes of {count * (size + 4)}")
    elapsed = time.perf_counter() - t
    s.close()
    if b" 200 " not in status:
        raise RuntimeError(f"{mode}: {status!r}")
    return elapsed


def compare_raw(go_server, runs, rounds=3):
    """
    The same bytes through styx/0 and HTTP to the Go server and to
    C{twistd styx-server}, alternately; return {(path, phase, size):
    (go rec/s median, ours median)}.
    """
    with styx_servers(go_server, "styx-go-raw-") as ports:
        results = {}
        for path, run in (("styx/0", styx0), ("HTTP", http)):
            for size, count in runs:
                for port in ports.values():     # a warm-up run each
                    run(port, "produce", size, count // 10)
                got = {side: {"produce": [], "consume": []} for side in ports}
                for _ in range(rounds):
                    for side, port in ports.items():
                        for phase in ("produce", "consume"):
                            got[side][phase].append(count / run(port, phase, size, count))
                for phase in ("produce", "consume"):
                    results[path, phase, size] = (statistics.median(got["go"][phase]),
                                                  statistics.median(got["ours"][phase]))
        return results
