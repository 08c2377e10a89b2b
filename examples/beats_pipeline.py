"""
Beats events -> lumberjack-server -> log store -> Spark Structured Streaming
-> per-host event counts per minute -> parquet files and a Styx log.

Two ways to run it:

    # Everything on this machine, in a temp dir: starts lumberjack-server and
    # styx-server over one store (twistd streamproto), sends Beats-style
    # events, runs the Spark job, sends more events, restarts the job from
    # its checkpoints, and checks that every event was counted exactly once.
    python examples/beats_pipeline.py demo

    # The job alone, against servers you run (twistd -n streamproto --data DIR):
    python examples/beats_pipeline.py run --store DIR --styx-url http://127.0.0.1:7123 \\
        --out counts/ --checkpoint checkpoints/ [--available-now]

Why it is exactly once (see doc/spark.rst):
- the source replays a micro-batch from its logged offsets (log positions),
  reading exactly the same records;
- the parquet sink commits each micro-batch once (its _spark_metadata log),
  so parquet has every (minute, host) count exactly once;
- the Styx log is at-least-once (a retried task appends again); each record
  carries its key (minute, host), so a consumer keeps the last record per key.

Needs the [spark] extra (pyspark >= 4.2, pyarrow) and Java 17.
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: How lumberjack-server stores an event: {"peer": ..., "tls": ..., "event": {beat event}}.
#: Only the fields the job needs are declared; the others are ignored.
RECORD_SCHEMA = ("peer STRING, event STRUCT<`@timestamp`: TIMESTAMP, "
                 "host: STRUCT<name: STRING>, message: STRING>")


def spark_session(master="local[2]"):
    """A SparkSession whose Python workers run this interpreter."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # Workers import streamproto: make this checkout importable (not needed
    # once streamproto is installed).
    paths = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from pyspark.sql import SparkSession

    from streamproto.spark import register

    spark = (SparkSession.builder.master(master).appName("beats-pipeline")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def host_counts(spark, store, log="lumberjack", max_records_per_trigger=100000):
    """
    Per-host event counts per minute, as a streaming DataFrame
    C{(minute TIMESTAMP, host STRING, count BIGINT)}.

    A minute is final once events one minute later have been seen (the
    watermark); only then is its count emitted, once.
    """
    from pyspark.sql import functions as F

    records = (spark.readStream.format("streamproto")
               .option("path", store)                 # executors read the segments directly
               .option("logs", log)
               .option("valueFormat", "json")
               .option("jsonSchema", RECORD_SCHEMA)
               .option("maxRecordsPerTrigger", str(max_records_per_trigger))
               .load())
    events = (records
              .select(F.col("value.event.`@timestamp`").alias("at"),
                      F.col("value.event.host.name").alias("host"))
              .where("at IS NOT NULL AND host IS NOT NULL"))  # a malformed record is null
    return (events
            .withWatermark("at", "1 minute")
            .groupBy(F.window("at", "1 minute"), "host")
            .count()
            .select(F.col("window.start").alias("minute"), "host", "count"))


def start_job(spark, store, styx_url, out, checkpoint, result_log="host-counts",
              available_now=False):
    """
    Start the two streaming queries (each with its own checkpoint):
    counts -> parquet (exactly once) and counts -> Styx log (at least once,
    keyed by minute and host).
    """
    from pyspark.sql import functions as F

    def with_trigger(writer):
        if available_now:
            return writer.trigger(availableNow=True)
        return writer.trigger(processingTime="5 seconds")

    counts = host_counts(spark, store)
    to_parquet = with_trigger(
        counts.writeStream.format("parquet").outputMode("append")
        .option("path", out)
        .option("checkpointLocation", os.path.join(checkpoint, "parquet"))
    ).start()
    as_records = counts.select(F.to_json(F.struct(
        F.date_format("minute", "yyyy-MM-dd'T'HH:mm:ssX").alias("minute"), "host", "count"))
        .alias("value"))
    to_styx = with_trigger(
        as_records.writeStream.format("streamproto").outputMode("append")
        .option("url", styx_url)
        .option("log", result_log)          # appended through styx/0, durable acks
        .option("checkpointLocation", os.path.join(checkpoint, "styx"))
    ).start()
    return [to_parquet, to_styx]


def run_until_caught_up(queries, timeout=300):
    for query in queries:
        query.awaitTermination(timeout)
        if query.exception() is not None:
            raise RuntimeError(f"query {query.name or query.id} failed: {query.exception()}")


# -- the self-contained demo --------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port, process, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the servers exited (exit status {process.returncode})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listens on port {port}")


def beats_events(start_minute, minutes, hosts, per_minute):
    """Filebeat-shaped events: @timestamp, host.name, message."""
    base = 1714564800 + 60 * start_minute  # 2024-05-01T12:00:00Z
    events = []
    for m in range(minutes):
        for h, host in enumerate(hosts):
            for i in range(per_minute + h):  # a different count per host
                at = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(base + 60 * m + i % 60))
                events.append({"@timestamp": at + ".000Z", "host": {"name": host},
                               "message": f"GET /item/{i} 200"})
    return events


def send_events(port, events, work):
    path = os.path.join(work, "events.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    subprocess.run([sys.executable, "-m", "streamproto", "lumberjack", "send",
                    "-s", f"127.0.0.1:{port}", path],
                   check=True, env=dict(os.environ, PYTHONPATH=ROOT))


def wait_for_records(store, log, count, timeout=30):
    from streamproto.log.reader import LogDirectoryReader
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if LogDirectoryReader(store).bounds(log)[1] >= count:
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{log}: fewer than {count} records after {timeout} s")


def expected_counts(events):
    """
    The counts the job must have emitted: those of every minute that ended
    at least one minute (the watermark delay) before the latest event.
    """
    import calendar

    def seconds(e):
        return calendar.timegm(time.strptime(e["@timestamp"][:19], "%Y-%m-%dT%H:%M:%S"))

    watermark = max(map(seconds, events)) - 60
    counts = {}
    for e in events:
        minute = e["@timestamp"][:16]
        if seconds(e) // 60 * 60 + 60 <= watermark:
            key = (minute, e["host"]["name"])
            counts[key] = counts.get(key, 0) + 1
    return counts


def demo(args):
    work = tempfile.mkdtemp(prefix="beats-pipeline-")
    store = os.path.join(work, "store")
    lumberjack_port, styx_port = free_port(), free_port()
    servers = subprocess.Popen(
        [sys.executable, "-c", "from twisted.scripts.twistd import run; run()",
         "-n", "--pidfile=", "streamproto",
         "--data", store, "--only", "lumberjack-server,styx-server", "--metrics", "none",
         "--listen", f"lumberjack-server=tcp:{lumberjack_port}:interface=127.0.0.1",
         "--listen", f"styx-server=tcp:{styx_port}:interface=127.0.0.1"],
        cwd=work, env=dict(os.environ, PYTHONPATH=ROOT),
        stdout=open(os.path.join(work, "servers.log"), "w"), stderr=subprocess.STDOUT)
    styx_url = f"http://127.0.0.1:{styx_port}"
    out, checkpoint = os.path.join(work, "counts"), os.path.join(work, "checkpoints")
    try:
        wait_for_port(lumberjack_port, servers)
        wait_for_port(styx_port, servers)
        hosts = ["web-1", "web-2", "db-1"]
        spark = spark_session(args.master)

        # Round 1: minutes 12:00-12:02 arrive; the job runs and stops.
        sent = beats_events(0, 3, hosts, 20)
        send_events(lumberjack_port, sent, work)
        wait_for_records(store, "lumberjack", len(sent))
        run_until_caught_up(start_job(spark, store, styx_url, out, checkpoint, available_now=True))
        print(f"round 1: {len(sent)} events sent, job stopped")

        # Round 2: later minutes arrive while the job is down; it restarts
        # from its checkpoints and carries on where it stopped.
        more = beats_events(3, 3, hosts, 20)
        send_events(lumberjack_port, more, work)
        sent += more
        wait_for_records(store, "lumberjack", len(sent))
        run_until_caught_up(start_job(spark, store, styx_url, out, checkpoint, available_now=True))
        print(f"round 2: {len(more)} more events sent, job restarted from its checkpoints")

        rows = spark.read.parquet(out).orderBy("minute", "host").collect()
        print("\nper-host counts per minute (parquet):")
        for r in rows:
            print(f"  {r['minute']:%Y-%m-%d %H:%M}  {r['host']:<6} {r['count']:>4}")
        got = {(r["minute"].strftime("%Y-%m-%dT%H:%M"), r["host"]): r["count"] for r in rows}
        want = expected_counts(sent)
        duplicates = len(rows) - len(got)

        from streamproto.spark.remote import StyxHTTPClient
        client = StyxHTTPClient(styx_url)
        start, end = client.bounds("host-counts")
        published = [json.loads(r) for b in client.read("host-counts", start, end)
                     for r in b.records()]
        latest = {(p["minute"][:16], p["host"]): p["count"] for p in published}
        print(f"\n{len(published)} records in the Styx log host-counts, e.g. {published[:1]}")
        ok = got == want and duplicates == 0 and latest == want
        print("\nexactly once:", "yes" if ok else f"NO (parquet {got}, expected {want})")
        spark.stop()
        return 0 if ok else 1
    finally:
        servers.terminate()
        servers.wait(30)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"work directory kept: {work}")


def run(args):
    spark = spark_session(args.master)
    queries = start_job(spark, args.store, args.styx_url, args.out, args.checkpoint,
                        result_log=args.result_log, available_now=args.available_now)
    if args.available_now:
        run_until_caught_up(queries)
    else:
        spark.streams.awaitAnyTermination()
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description="Beats -> log store -> Spark pipeline.")
    parser.add_argument("--master", default="local[2]")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run everything locally and check exactly-once")
    d.add_argument("--keep", action="store_true", help="keep the work directory")
    r = sub.add_parser("run", help="run the streaming job")
    r.add_argument("--store", required=True, help="the log store directory the servers write")
    r.add_argument("--styx-url", required=True, help="styx-server base URL for the results")
    r.add_argument("--out", required=True, help="parquet output directory")
    r.add_argument("--checkpoint", required=True, help="checkpoint directory (keep it!)")
    r.add_argument("--result-log", default="host-counts")
    r.add_argument("--available-now", action="store_true",
                   help="process what is there, then stop (e.g. from cron)")
    args = parser.parse_args(argv)
    return demo(args) if args.command == "demo" else run(args)


if __name__ == "__main__":
    sys.exit(main())
