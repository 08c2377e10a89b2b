"""
What running without the C accelerator costs: record framing and scanning
(the per-record work of every Styx produce and consume) and Lumberjack's
JSON frames scanned and spliced into log records (the per-event work of
every Lumberjack batch) by the accelerator and by the pure-Python
fallback, on the same batch, in the same run.

    python bench/accel_cost.py                 # 1000 records of 100 B
    python bench/accel_cost.py --records 100 --size 1000

Prints microseconds per batch for each and the ratio (pure / C); the
server's start-up warning and doc/performance.rst quote it.  Ratios are
steadier than times on a shared machine.
"""

import argparse
import os
import sys
import time
from array import array

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.benchenv import measured  # noqa: E402
measured()   # which streamproto and path this measures (bench/benchenv.py)

from streamproto import _speedups  # noqa: E402
from streamproto.core import framing  # noqa: E402
from streamproto.lumberjack import runs  # noqa: E402
from streamproto.lumberjack.codec import encode_json_frames  # noqa: E402

PREFIX = b"\x00\x01"    # styx/0's record message type


def best_of(call, repeat, rounds=5):
    """The best time of C{rounds} rounds of C{repeat} calls, per call, in seconds."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(repeat):
            call()
        best = min(best, (time.perf_counter() - started) / repeat)
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=1000, help="records per batch (1000)")
    p.add_argument("--size", type=int, default=100, help="bytes per record (100)")
    args = p.parse_args(argv)
    lengths = array("I", [args.size] * args.records)
    data = bytes(args.size * args.records)
    wire = framing.frame_records_py(lengths, data, PREFIX)
    max_size = 1 << 20
    cases = [
        ("frame (produce's acks, consume's sends)",
         lambda: _speedups.frame_records(lengths, data, PREFIX),
         lambda: framing.frame_records_py(lengths, data, PREFIX)),
        ("scan (produce's decode)",
         lambda: _speedups.scan_frames(wire, 0, PREFIX, max_size, -1),
         lambda: framing.scan_frames_py(wire, 0, PREFIX, max_size, -1)),
    ]
    # a Lumberjack batch of as many JSON events of the same size
    event = b'{"message":"' + b"x" * max(0, args.size - 14) + b'"}'
    events = [event] * args.records
    lj_wire = encode_json_frames(events)
    lj_lengths = array("I", map(len, events))
    lj_data = b"".join(events)
    meta = b'{"peer":"10.0.0.7:51234","event":'
    cases += [
        ("Lumberjack JSON frames scan",
         lambda: _speedups.lumberjack_json(lj_wire, 0, 0x32, max_size, -1),
         lambda: runs.scan_json_py(lj_wire, 0, 0x32, max_size, -1)),
        ("Lumberjack events spliced into records",
         lambda: _speedups.splice(lj_lengths, lj_data, b"", meta, b"}", b""),
         lambda: runs.splice_py(lj_lengths, lj_data, b"", meta, b"}", b"")),
    ]
    print(f"batch of {args.records} records of {args.size} B (shared machine: ratios, not "
          "times, are what holds)")
    print(f"{'':<42} {'C us':>9} {'Python us':>10} {'Python/C':>9}")
    for label, c, py in cases:
        assert c() == py(), label      # the same result, or the ratio means nothing
        t_c = best_of(c, 200)
        t_py = best_of(py, 20)
        print(f"{label:<42} {t_c * 1e6:>9.1f} {t_py * 1e6:>10.1f} {t_py / t_c:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
