"""
Spark batch scan of the log store vs. the same records in a parquet file.

    python bench/spark_bench.py                  # 1M records of 100 bytes
    python bench/spark_bench.py --records 10000000

Writes N records of --size bytes into a fresh file log store (through the
store's own append path), the same rows (log, position, value) into a
parquet file, then on local[2] times, for each source:

- count():                      every row reaches Spark;
- sum(length(value)):           every value byte reaches Spark (parquet
                                cannot answer from its footer).

Prints rows/s and the log-store / parquet ratio.  The machine may be shared:
run it twice and look at the better figures.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time


def populate_store(path, records, size, chunk=20000):
    from twisted.internet.task import Clock

    from streamproto.log import open_store
    from streamproto.log.file import synchronous

    store = open_store(path, reactor=Clock(), run_blocking=synchronous, retention_interval=0)
    results = []
    store.create("bench").addBoth(results.append)
    log = results.pop()
    payload = [bytes([65 + (i % 26)]) * size for i in range(chunk)]
    written = 0
    while written < records:
        n = min(chunk, records - written)
        log.append(payload[:n]).addBoth(results.append)
        outcome = results.pop()
        if not hasattr(outcome, "end_position"):
            outcome.raiseException()
        written += n
    store.close()


def populate_parquet(path, records, size, chunk=1_000_000):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from streamproto.spark.arrow import binary_array, positions_array
    from streamproto.log.batch import lengths_array

    schema = pa.schema([("log", pa.string(), False), ("position", pa.int64(), False),
                        ("value", pa.binary())])
    with pq.ParquetWriter(path, schema) as writer:
        written = 0
        while written < records:
            n = min(chunk, records - written)
            data = b"".join(bytes([65 + ((written + i) % 26)]) * size for i in range(n))
            batch = pa.RecordBatch.from_arrays(
                [pa.repeat(pa.scalar("bench", pa.string()), n), positions_array(written, n),
                 binary_array(lengths_array([size] * n), data)], schema=schema)
            writer.write_batch(batch)
            written += n


SERVER = """
import sys
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from streamproto.log import open_store
from streamproto.styx.resource import make_site
store = open_store(sys.argv[1], reactor=reactor)
def ready(port):
    print(port.getHost().port, flush=True)
TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(make_site(store)).addCallback(ready)
reactor.run()
"""


def start_styx_server(store_path, root):
    import subprocess
    env = dict(os.environ, PYTHONPATH=root)
    server = subprocess.Popen([sys.executable, "-c", SERVER, store_path],
                              stdout=subprocess.PIPE, env=env)
    port = int(server.stdout.readline())
    return server, f"http://127.0.0.1:{port}"


def timed(label, records, action, repeat):
    best = None
    for _ in range(repeat):
        started = time.perf_counter()
        result = action()
        elapsed = time.perf_counter() - started
        best = elapsed if best is None else min(best, elapsed)
    rate = records / best
    print(f"  {label:<44} {best:7.2f} s  {rate / 1e6:6.2f} M rows/s  (result {result})")
    return rate


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--max-records-per-partition", type=int, default=1_000_000)
    parser.add_argument("--arrow-batch-records", type=int, default=65536)
    parser.add_argument("--remote", action="store_true",
                        help="also read through a styx-server (HTTP API) over the same store, "
                             "and write the records back through the sink (styx/0)")
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    args = parser.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, root)
    from bench.benchenv import measured
    measured()      # which streamproto and path this measures (bench/benchenv.py)

    work = args.dir or tempfile.mkdtemp(prefix="spark-bench-")
    store_path = os.path.join(work, "store")
    parquet_path = os.path.join(work, "records.parquet")
    try:
        started = time.perf_counter()
        populate_store(store_path, args.records, args.size)
        print(f"log store: {args.records} x {args.size} B written in "
              f"{time.perf_counter() - started:.1f} s")
        started = time.perf_counter()
        populate_parquet(parquet_path, args.records, args.size)
        print(f"parquet:   written in {time.perf_counter() - started:.1f} s")

        from pyspark.sql import SparkSession
        from pyspark.sql import functions as F

        from streamproto.spark import register

        spark = (SparkSession.builder.master(args.master).appName("streamproto-bench")
                 .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
                 .config("spark.sql.shuffle.partitions", "2")
                 .getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        register(spark)
        logs = (spark.read.format("streamproto").option("path", store_path)
                .option("maxRecordsPerPartition", str(args.max_records_per_partition))
                .option("arrowBatchRecords", str(args.arrow_batch_records)).load())
        parquet = spark.read.parquet(parquet_path)

        def value_bytes(df):
            return lambda: df.agg(F.sum(F.length("value"))).collect()[0][0]

        # Warm up the JVM and the Python workers once for each source.
        logs.limit(10).collect()
        parquet.limit(10).collect()

        print(f"{args.records} records of {args.size} B on {args.master}, best of {args.repeat}:")
        log_count = timed("log store  count()", args.records, logs.count, args.repeat)
        pq_count = timed("parquet    count()", args.records, parquet.count, args.repeat)
        log_sum = timed("log store  sum(length(value))", args.records, value_bytes(logs),
                        args.repeat)
        pq_sum = timed("parquet    sum(length(value))", args.records, value_bytes(parquet),
                       args.repeat)
        print(f"ratio log store / parquet: count() {log_count / pq_count:.2f}, "
              f"sum(length(value)) {log_sum / pq_sum:.2f}")
        if args.remote:
            server, url = start_styx_server(store_path, root)
            try:
                remote = (spark.read.format("streamproto").option("url", url)
                          .option("maxRecordsPerPartition", str(args.max_records_per_partition))
                          .load())
                remote_sum = timed("styx-server (HTTP) sum(length(value))", args.records,
                                   value_bytes(remote), args.repeat)
                print(f"ratio styx-server / parquet: sum(length(value)) {remote_sum / pq_sum:.2f}")
                runs = iter(range(args.repeat))

                def write_back():
                    (parquet.select("value").write.format("streamproto").mode("append")
                     .option("url", url).option("log", f"written-{next(runs)}").save())
                    return "appended"
                timed("sink: parquet -> styx-server (styx/0)", args.records, write_back,
                      args.repeat)
            finally:
                server.terminate()
                server.wait(30)
        spark.stop()
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
