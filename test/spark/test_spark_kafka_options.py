"""
The options Spark users bring from the Kafka source: C{startingOffsets} /
C{endingOffsets} (per log, as JSON, batch and streaming),
C{maxOffsetsPerTrigger}, C{logsPattern}; and unknown or misspelled options
refused instead of ignored.  Parsing and planning on their own, then on a
real SparkSession.
"""

import json
import os

from twisted.trial.unittest import SynchronousTestCase

from streamproto.spark.options import (
    OptionError, parse_offsets, parse_sink_options, parse_source_options,
)
from streamproto.spark.planning import OffsetError, resolve_end, resolve_start, select_logs
from test.spark.test_spark import append, new_dir, spark


class ParsingTests(SynchronousTestCase):

    def test_offsets(self):
        self.assertEqual(parse_offsets("earliest", "startingOffsets"), "earliest")
        self.assertEqual(parse_offsets(" LATEST ", "startingOffsets"), "latest")
        self.assertIsNone(parse_offsets(None, "startingOffsets"))
        self.assertEqual(parse_offsets('{"a": 5, "b": -2, "c": {"0": -1}}', "startingOffsets"),
                         {"a": 5, "b": -2, "c": -1})
        self.assertEqual(parse_offsets('{"beats": {"n1:7123": 3, "n2:7123": 4}}',
                                       "startingOffsets", fleet=True),
                         {"n1:7123/beats": 3, "n2:7123/beats": 4})
        for bad, why in [("soon", "earliest, latest or a JSON"),
                         ("[1]", "a JSON object"),
                         ('{"a": -3}', "log 'a'"),
                         ('{"a": "5"}', "log 'a'"),
                         ('{"a": true}', "log 'a'"),
                         ('{"a": {"1": 5}}', 'one partition, "0"'),
                         ('{"a/b": 5}', "invalid log name")]:
            e = self.assertRaises(OptionError, parse_offsets, bad, "startingOffsets")
            self.assertIn(why, str(e), bad)

    def test_unknown_options_named(self):
        e = self.assertRaises(OptionError, parse_source_options,
                              {"path": "/d", "startingOffset": "earliest"})
        self.assertIn("unknown read option 'startingOffset' (did you mean 'startingOffsets'?)",
                      str(e))
        e = self.assertRaises(OptionError, parse_source_options, {"path": "/d", "colour": "x"})
        self.assertNotIn("did you mean", str(e))
        e = self.assertRaises(OptionError, parse_sink_options,
                              {"url": "http://h:1", "log": "l", "batchrecord": "5"})
        self.assertIn("did you mean 'batchRecords'", str(e))
        # Spark's own options reach a streaming sink (in lower case): accepted
        parse_sink_options({"url": "http://h:1", "log": "l", "checkpointlocation": "/c",
                            "queryname": "q"})
        # a Kafka user's option is answered with ours
        e = self.assertRaises(OptionError, parse_source_options,
                              {"path": "/d", "subscribePattern": "beats-.*"})
        self.assertIn("the Kafka source's 'subscribePattern' is 'logsPattern' here", str(e))
        e = self.assertRaises(OptionError, parse_source_options,
                              {"path": "/d", "kafka.bootstrap.servers": "h:9092"})
        self.assertIn("is 'url', 'path' or 'store' here", str(e))
        e = self.assertRaises(OptionError, parse_source_options,
                              {"path": "/d", "startingtimestamp": "1000"})
        self.assertIn("'startingTimestamp' has no equivalent here", str(e))
        self.assertNotIn("did you mean", str(e))
        # option names are case-insensitive, as Spark's are
        self.assertEqual(parse_source_options({"PATH": "/d", "MAXOFFSETSPERTRIGGER": "7"})
                         .max_records_per_trigger, 7)

    def test_aliases_and_exclusions(self):
        opts = parse_source_options({"path": "/d", "maxOffsetsPerTrigger": "100"})
        self.assertEqual(opts.max_records_per_trigger, 100)
        self.assertRaises(OptionError, parse_source_options,
                          {"path": "/d", "maxOffsetsPerTrigger": "1", "maxRecordsPerTrigger": "2"})
        self.assertEqual(parse_source_options({"path": "/d", "startingPosition": "latest"})
                         .starting_offsets, "latest")
        self.assertRaises(OptionError, parse_source_options,
                          {"path": "/d", "startingPosition": "latest",
                           "startingOffsets": "earliest"})
        self.assertRaises(OptionError, parse_source_options,
                          {"path": "/d", "logs": "a", "logsPattern": "a.*"})
        e = self.assertRaises(OptionError, parse_source_options,
                              {"path": "/d", "logsPattern": "("})
        self.assertIn("not a regular expression", str(e))


class PlanningTests(SynchronousTestCase):
    bounds = {"a": (10, 50), "b": (0, 5)}

    def test_start(self):
        self.assertEqual(resolve_start("earliest", self.bounds, batch=True), {"a": 10, "b": 0})
        self.assertEqual(resolve_start("latest", self.bounds, batch=False), {"a": 50, "b": 5})
        self.assertEqual(resolve_start({"a": 20}, self.bounds, batch=True), {"a": 20, "b": 0})
        self.assertEqual(resolve_start({"a": -1, "b": -2}, self.bounds, batch=False),
                         {"a": 50, "b": 0})
        self.assertRaises(OffsetError, resolve_start, "latest", self.bounds, batch=True)
        self.assertRaises(OffsetError, resolve_start, {"a": -1}, self.bounds, batch=True)
        self.assertRaises(OffsetError, resolve_start, {"a": 51}, self.bounds, batch=True)
        e = self.assertRaises(OffsetError, resolve_start, {"zz": 1}, self.bounds, batch=True)
        self.assertIn("'zz'", str(e))

    def test_end(self):
        self.assertEqual(resolve_end(None, self.bounds), {"a": 50, "b": 5})
        self.assertEqual(resolve_end({"a": 30}, self.bounds), {"a": 30, "b": 5})
        self.assertRaises(OffsetError, resolve_end, "earliest", self.bounds)
        self.assertRaises(OffsetError, resolve_end, {"b": 6}, self.bounds)

    def test_pattern_is_whole_name(self):
        bounds = {"beats-1": (0, 1), "beats-2": (0, 1), "xbeats-1": (0, 1), "n:1/beats-3": (0, 1)}
        self.assertEqual(sorted(select_logs(bounds, r"beats-\d")),
                         ["beats-1", "beats-2", "n:1/beats-3"])
        self.assertEqual(select_logs(bounds, None), bounds)


class SparkTests(SynchronousTestCase):

    def setUp(self):
        self.path = new_dir(self)
        append(self.path, "beats-1", [b"one-%d" % i for i in range(20)])
        append(self.path, "beats-2", [b"two-%d" % i for i in range(10)])
        append(self.path, "other", [b"x"])

    def read(self, **options):
        reader = spark().read.format("streamproto").option("path", self.path)
        for key, value in options.items():
            reader = reader.option(key, value)
        return sorted((r["log"], r["position"]) for r in reader.load().collect())

    def test_batch_offsets(self):
        rows = self.read(logsPattern="beats-.*",
                         startingOffsets=json.dumps({"beats-1": 15}),
                         endingOffsets=json.dumps({"beats-1": 18, "beats-2": {"0": 3}}))
        self.assertEqual(rows, [("beats-1", 15), ("beats-1", 16), ("beats-1", 17),
                                ("beats-2", 0), ("beats-2", 1), ("beats-2", 2)])
        # startingPosition is no longer ignored in batch reads
        with self.assertRaises(Exception) as raised:
            self.read(startingPosition="latest")
        self.assertIn("not allowed in a batch query", str(raised.exception))

    def test_unknown_option_fails_the_read(self):
        with self.assertRaises(Exception) as raised:
            self.read(startingOffset="earliest")
        self.assertIn("did you mean 'startingOffsets'", str(raised.exception))

    def test_unknown_option_fails_the_write(self):
        # save(path) adds Spark's own 'path': accepted; the misspelling is not.
        frame = spark().createDataFrame([(b"x",)], "value BINARY")
        with self.assertRaises(Exception) as raised:
            (frame.write.format("streamproto").mode("append")
             .option("url", "http://127.0.0.1:1").option("log", "out")
             .option("createLogs", "false").save(self.path))
        self.assertIn("did you mean 'createLog'", str(raised.exception))
        self.assertNotIn("'path'", str(raised.exception).split("known:")[0])

    def test_streaming(self):
        work = new_dir(self)
        out, checkpoint = os.path.join(work, "out"), os.path.join(work, "cp")

        def run(**options):
            reader = spark().readStream.format("streamproto").option("path", self.path)
            for key, value in options.items():
                reader = reader.option(key, value)
            query = (reader.load().writeStream.format("parquet").option("path", out)
                     .option("checkpointLocation", checkpoint)
                     .trigger(availableNow=True).start())
            query.awaitTermination(120)
            self.assertIsNone(query.exception())
            return [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]

        options = dict(logsPattern="beats-[0-9]+", maxOffsetsPerTrigger="8",
                       startingOffsets=json.dumps({"beats-1": 12, "beats-2": -1}))
        self.assertEqual(run(**options), [8])
        append(self.path, "beats-2", [b"two-new"])
        append(self.path, "beats-3", [b"three-0"])
        # the checkpoint decides now: startingOffsets only applies to a new query
        self.assertEqual(run(**options), [2])
        rows = sorted((r["log"], r["position"]) for r in spark().read.parquet(out).collect())
        self.assertEqual(rows, [("beats-1", i) for i in range(12, 20)]
                         + [("beats-2", 10), ("beats-3", 0)])
        with self.assertRaises(Exception) as raised:
            run(endingOffsets="latest")
        self.assertIn("endingOffsets is for batch queries", str(raised.exception))
