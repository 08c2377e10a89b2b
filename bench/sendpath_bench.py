"""
What a consumer's send path could cost if the stored bytes were the wire
bytes: the question behind "store records as styx/0 frames and send them
with sendfile" (doc/styx-stream.rst, "Against the Go reference").

    python bench/sendpath_bench.py [--mb 200] [--rounds 7] [--size 1000]

A file of SIZE-byte records (in the page cache) is sent over loopback TCP
to a reader in another process, 1 MiB at a time, four ways:

  - iovecs: what the server does today: C{pread}, CRC-32C, then
    C{sendmsg} with each record's 6-byte frame header and its payload as
    two iovecs (C{streamproto._speedups.send_frames});
  - contiguous: C{pread}, CRC, one C{sendmsg} of the bytes as they lie
    (what a store keeping the frames on disk would send);
  - sendfile+crc: C{pread} and CRC (every read is checksummed), then
    C{sendfile} of the same range;
  - sendfile: C{sendfile} alone (no checksum: not a choice, a bound).

It prints the sender's CPU time (user + system of the sending thread, the
loopback delivery to the reader included) per run, medians, and each as a
ratio to the first.
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from array import array

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.benchenv import measured  # noqa: E402
measured()   # which streamproto and path this measures (bench/benchenv.py)

READER = r"""
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
buf = bytearray(1 << 20)
while s.recv_into(buf):
    pass
"""

CHUNK = 1 << 20


def sender_cpu(send):
    """Run C{send(sock)} against a reader process; the sending thread's CPU seconds."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    reader = subprocess.Popen([sys.executable, "-c", READER, str(listener.getsockname()[1])])
    sock, _ = listener.accept()
    listener.close()
    try:
        c0 = time.thread_time()
        send(sock)
        cpu = time.thread_time() - c0
        sock.shutdown(socket.SHUT_WR)
        reader.wait()
        return cpu
    finally:
        sock.close()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200, help="MiB sent per run (200)")
    parser.add_argument("--rounds", type=int, default=7, help="alternated runs of each (7)")
    parser.add_argument("--size", type=int, default=1000, help="record size in bytes (1000)")
    args = parser.parse_args(argv)
    if args.mb <= 0 or args.rounds <= 0 or not 1 <= args.size <= CHUNK:
        parser.error("--mb, --rounds and --size must be positive (--size at most 1 MiB)")
    from crc32c import crc32c

    from streamproto.core.framing import _speedups
    if _speedups is None:
        parser.error("the C accelerator is not built (python setup.py build_ext --inplace)")

    per = CHUNK // args.size
    span = per * args.size
    total = args.mb * CHUNK // span * span
    lengths = array("I", [args.size] * per)
    with tempfile.NamedTemporaryFile(prefix="sendpath-") as f:
        f.write(os.urandom(total))
        f.flush()
        fd = f.fileno()
        os.pread(fd, total, 0)      # into the page cache

        def iovecs(sock):
            for off in range(0, total, span):
                data = os.pread(fd, span, off)
                crc32c(data)
                index = skip = 0
                while index < per:
                    index, skip, _ = _speedups.send_frames(
                        sock.fileno(), lengths, data, b"\x00\x01", index, skip)

        def contiguous(sock):
            for off in range(0, total, span):
                data = os.pread(fd, span, off)
                crc32c(data)
                sock.sendall(data)

        def sendfile_all(sock, offset, n):
            sent = 0
            while sent < n:
                sent += os.sendfile(sock.fileno(), fd, offset + sent, n - sent)

        def sendfile_crc(sock):
            for off in range(0, total, span):
                crc32c(os.pread(fd, span, off))
                sendfile_all(sock, off, span)

        def sendfile_only(sock):
            for off in range(0, total, span):
                sendfile_all(sock, off, span)

        ways = {"iovecs": iovecs, "contiguous": contiguous,
                "sendfile+crc": sendfile_crc, "sendfile": sendfile_only}
        runs = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, send in ways.items():
                runs[name].append(sender_cpu(send))
    base = statistics.median(runs["iovecs"])
    print(f"{total >> 20} MiB of {args.size} B records over loopback, {args.rounds} "
          "alternated runs, sender CPU (ms), medians")
    print(f"{'way':<14} | {'median':>8} | {'vs iovecs':>9} | runs")
    for name, values in runs.items():
        m = statistics.median(values)
        print(f"{name:<14} | {m * 1000:>8.1f} | {m / base:>9.2f} | "
              + " ".join(f"{v * 1000:.0f}" for v in values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
