"""
The data source's options, parsed and checked once on the driver.

Pure Python (no Spark, no I/O) so that it can be tested on its own and so
that a bad option fails at C{load()} with a clear message instead of inside
an executor.
"""

import difflib
import json
import re
from dataclasses import dataclass

from streamproto.log.config import validate_name
from streamproto.spark.remote import TLSFiles

#: The name that C{spark.read.format(...)} takes.
FORMAT_NAME = "streamproto"

VALUE_FORMATS = ("binary", "utf8", "json")

#: Default number of records one Spark task reads: big enough that the per
#: task cost (a Python worker round trip, opening the log's segments) is
#: noise, small enough that a 10M-record log keeps a few cores busy.
DEFAULT_MAX_RECORDS_PER_PARTITION = 1_000_000

#: Arrow batches handed to Spark are cut at about this many payload bytes or
#: records, whichever comes first (the store's own batches may be much smaller:
#: one per append).
DEFAULT_ARROW_BATCH_BYTES = 8 * 1024 * 1024
DEFAULT_ARROW_BATCH_RECORDS = 65536

_URL = re.compile(r"^https?://[^/\s]+(/[^\s]*)?$")


class OptionError(ValueError):
    """An option of the streamproto data source is missing or invalid."""


#: every option a read takes (Spark adds C{path} for C{.load(path)})
SOURCE_OPTIONS = (
    "path", "url", "store", "logs", "log", "logsPattern", "valueFormat", "jsonSchema",
    "startingOffsets", "endingOffsets", "startingPosition", "maxRecordsPerTrigger",
    "maxOffsetsPerTrigger", "maxRecordsPerPartition", "minPartitions", "failOnDataLoss",
    "timeout", "arrowBatchBytes", "arrowBatchRecords", "caCerts", "certificate", "privateKey",
)
#: every option a write takes (a streaming write also gets Spark's own
#: C{checkpointLocation} and C{queryName})
SINK_OPTIONS = (
    "url", "log", "logs", "protocol", "batchRecords", "batchBytes", "timeout", "createLog",
    "caCerts", "certificate", "privateKey", "checkpointLocation", "queryName", "path",
)


#: Kafka source options spelled differently here (or with no equivalent:
#: None), so that a Kafka user's option is answered with ours rather than
#: a far-fetched "did you mean".
KAFKA_OPTIONS = {
    "kafka.bootstrap.servers": "'url', 'path' or 'store'",
    "subscribe": "'logs'",
    "subscribePattern": "'logsPattern'",
    "assign": "'logs'",
    "startingTimestamp": None,
    "startingOffsetsByTimestamp": None,
    "endingTimestamp": None,
    "endingOffsetsByTimestamp": None,
    "includeHeaders": None,
    "minOffsetsPerTrigger": None,
    "maxTriggerDelay": None,
    "groupIdPrefix": None,
    "kafka.group.id": None,
}


def check_known(options, known, what):
    """
    @raise OptionError: for an option that is not one of C{known}
        (case-insensitive, as Spark's options are), naming the closest one,
        or ours for a Kafka source option.
    """
    lookup = {k.lower(): k for k in known}
    kafka = {k.lower(): (k, ours) for k, ours in KAFKA_OPTIONS.items()}
    for key in options:
        if str(key).lower() in lookup:
            continue
        close = difflib.get_close_matches(str(key).lower(), list(lookup), n=1, cutoff=0.6)
        hint = f" (did you mean {lookup[close[0]]!r}?)" if close else ""
        if str(key).lower() in kafka:
            name, ours = kafka[str(key).lower()]
            hint = (f" (the Kafka source's {name!r} is {ours} here)" if ours else
                    f" (the Kafka source's {name!r} has no equivalent here: see doc/spark.rst)")
        raise OptionError(f"unknown {what} option {key!r}{hint}; known: "
                          f"{', '.join(k for k in known if k != 'path')}")


#: Kafka's special positions in startingOffsets/endingOffsets JSON
LATEST, EARLIEST = -1, -2


def parse_offsets(raw, option, fleet=False):
    """
    C{startingOffsets}/C{endingOffsets} as the Kafka source takes them:
    C{"earliest"}, C{"latest"}, or a JSON object with a position per log
    (C{{"events": 120, "beats": -2}}: -2 is earliest, -1 latest), also in
    Kafka's nested form with a partition: C{{"events": {"0": 120}}} (our
    logs have one partition, C{"0"}; reading several servers, the
    partitions are the nodes: C{{"beats": {"styx-1:7123": 10}}}).

    @return: C{"earliest"}, C{"latest"}, or a dict offset key -> position
        (or L{EARLIEST}/L{LATEST}).
    """
    if raw is None or str(raw).strip() == "":
        return None
    text = str(raw).strip()
    if text.lower() in ("earliest", "latest"):
        return text.lower()
    try:
        document = json.loads(text)
    except ValueError:
        raise OptionError(f"option {option!r} must be earliest, latest or a JSON object "
                          f"{{\"log\": position}}, not {text!r}")
    if not isinstance(document, dict) or not document:
        raise OptionError(f"option {option!r}: a JSON object {{\"log\": position}}, "
                          f"not {text!r}")
    from streamproto.spark.planning import node_key
    offsets = {}
    for log, value in document.items():
        entries = value.items() if isinstance(value, dict) else [(None, value)]
        for partition, position in entries:
            if isinstance(position, bool) or not isinstance(position, int) or position < -2:
                raise OptionError(f"option {option!r}: log {log!r}: a position, -1 (latest) "
                                  f"or -2 (earliest), not {position!r}")
            if partition is None:
                key = log
            elif fleet:
                key = node_key(partition, log)
            elif partition == "0":
                key = log
            else:
                raise OptionError(f"option {option!r}: log {log!r} has one partition, \"0\", "
                                  f"not {partition!r}")
            try:
                validate_name(log)
            except Exception as e:
                raise OptionError(f"option {option!r}: invalid log name {log!r}: {e}")
            offsets[key] = position
    return offsets


@dataclass(frozen=True)
class SourceOptions:
    """
    Where and how to read.

    @ivar path: a local log store directory (readable on every executor), or None.
    @ivar urls: a tuple of styx-server base URLs (without trailing slash), or ().
        With a C{path}, one URL: the server that owns that directory, asked
        for the logs' synced ends while the records are read from the files.
    @ivar store: a JetStream store URL (C{nats://...}): executors read the
        logs straight from the cluster; or None.
    @ivar logs: a tuple of log names, or None for every log.
    """

    path: str | None = None
    urls: tuple = ()
    store: str | None = None
    logs: tuple | None = None
    logs_pattern: str | None = None
    max_records_per_trigger: int | None = None
    max_records_per_partition: int = DEFAULT_MAX_RECORDS_PER_PARTITION
    min_partitions: int = 2
    value_format: str = "binary"
    json_schema: str | None = None
    starting_offsets: object = "earliest"
    ending_offsets: object = None
    fail_on_data_loss: bool = True
    timeout: float = 30.0
    arrow_batch_bytes: int = DEFAULT_ARROW_BATCH_BYTES
    arrow_batch_records: int = DEFAULT_ARROW_BATCH_RECORDS
    tls: TLSFiles | None = None

    @property
    def fleet(self):
        """
        Several styx-servers (and no directory): a log name found on several
        of them is one partitioned stream, read per node, with a C{node}
        column and offsets per node and log.
        """
        return self.path is None and len(self.urls) > 1


def _get(options, key):
    # Spark hands a case-insensitive dict; plain dicts in tests may not be.
    if key in options:
        return options[key]
    lowered = {k.lower(): v for k, v in options.items()}
    return lowered.get(key.lower())


def _not_both(given, other, one, another):
    """
    Refuse a read that gives two options meaning the same thing (an option
    and its older name, or two ways of naming the logs): which one wins
    would be a guess.  C{one} and C{another} name them in the message.
    """
    if given is not None and other is not None:
        raise OptionError(f"give {one} or {another}, not both")


def _positive_int(options, key, default, minimum=1):
    raw = _get(options, key)
    if raw is None or str(raw).strip() == "":
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise OptionError(f"option {key!r} must be an integer, not {raw!r}")
    if value < minimum:
        raise OptionError(f"option {key!r} must be >= {minimum}, not {value}")
    return value


def _bool(options, key, default):
    raw = _get(options, key)
    if raw is None:
        return default
    text = str(raw).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise OptionError(f"option {key!r} must be true or false, not {raw!r}")


def split_list(raw):
    """C{"a, b,,c"} -> C{("a", "b", "c")}."""
    if raw is None:
        return ()
    return tuple(p.strip() for p in str(raw).split(",") if p.strip())


def parse_urls(raw):
    urls = []
    for url in split_list(raw):
        if not _URL.match(url):
            raise OptionError(f"option 'url': not an http(s) base URL: {url!r}")
        url = url.rstrip("/")
        if url not in urls:
            urls.append(url)
    return tuple(urls)


def parse_tls(options):
    """The C{caCerts}, C{certificate} and C{privateKey} options, or None."""
    ca_certs, certificate, private_key = (
        _get(options, key) or None for key in ("caCerts", "certificate", "privateKey"))
    if bool(certificate) != bool(private_key):
        raise OptionError("give both 'certificate' and 'privateKey' (the client's), or neither")
    if not (ca_certs or certificate):
        return None
    return TLSFiles(ca_certs, certificate, private_key)


def parse_source_options(options):
    """
    @param options: the (case-insensitive) options dict Spark gives the data source.
    @return: a L{SourceOptions}.
    @raise OptionError: for a missing, invalid or unknown option.
    """
    check_known(options, SOURCE_OPTIONS, "read")
    path = _get(options, "path")
    path = str(path) if path not in (None, "") else None
    urls = parse_urls(_get(options, "url"))
    store = _get(options, "store")
    store = str(store).strip() if store not in (None, "") else None
    if store is not None:
        from streamproto.log.storeurl import StoreURLError, parse_store_url
        try:
            store = str(parse_store_url(store))
        except StoreURLError as e:
            raise OptionError(f"option 'store': {e}")
        if path is not None or urls:
            raise OptionError("option 'store' (a JetStream cluster) goes alone: not with "
                              "'path' or 'url'")
    elif path is None and not urls:
        raise OptionError("give the option 'path' (a local log store directory) or 'url' "
                          "(styx-server base URLs, comma-separated), or both (the ends of the "
                          "logs from the server, the records from its directory), or 'store' "
                          "(nats://HOST:PORT,...: a JetStream store)")
    if path is not None and len(urls) > 1:
        raise OptionError("with 'path', give at most one 'url': the server that owns that "
                          "store directory")

    logs = _get(options, "logs")
    if logs is None:
        logs = _get(options, "log")
    if logs is not None:
        logs = split_list(logs)
        if not logs:
            raise OptionError("option 'logs' is empty")
        for name in logs:
            try:
                validate_name(name)
            except Exception as e:
                raise OptionError(f"option 'logs': invalid log name {name!r}: {e}")
        logs = tuple(dict.fromkeys(logs))

    value_format = str(_get(options, "valueFormat") or "binary").strip().lower()
    if value_format == "utf-8":
        value_format = "utf8"
    if value_format not in VALUE_FORMATS:
        raise OptionError(f"option 'valueFormat' must be one of {', '.join(VALUE_FORMATS)}, "
                          f"not {value_format!r}")
    json_schema = _get(options, "jsonSchema")
    if value_format == "json":
        if not json_schema or not str(json_schema).strip():
            raise OptionError("valueFormat=json needs the option 'jsonSchema' (a DDL string "
                              "such as 'host STRING, n INT', or a StructType's JSON)")
        json_schema = str(json_schema).strip()
    elif json_schema:
        raise OptionError("option 'jsonSchema' only applies with valueFormat=json")

    fleet = path is None and len(urls) > 1
    starting = parse_offsets(_get(options, "startingOffsets"), "startingOffsets", fleet)
    legacy = _get(options, "startingPosition")
    _not_both(starting, legacy, "'startingOffsets'", "its older name 'startingPosition'")
    if legacy is not None:
        starting = str(legacy).strip().lower()
        if starting not in ("earliest", "latest"):
            raise OptionError(f"option 'startingPosition' must be earliest or latest, "
                              f"not {starting!r}")
    ending = parse_offsets(_get(options, "endingOffsets"), "endingOffsets", fleet)

    pattern = _get(options, "logsPattern")
    _not_both(logs, pattern, "'logs' (names)", "'logsPattern' (a regular expression)")
    if pattern is not None:
        try:
            re.compile(str(pattern))
        except re.error as e:
            raise OptionError(f"option 'logsPattern': not a regular expression: {e}")
        pattern = str(pattern)

    per_trigger = _positive_int(options, "maxRecordsPerTrigger", None)
    alias = _positive_int(options, "maxOffsetsPerTrigger", None)
    if alias is not None:
        if per_trigger is not None and per_trigger != alias:
            raise OptionError("'maxOffsetsPerTrigger' is another name of 'maxRecordsPerTrigger': "
                              "give one")
        per_trigger = alias

    timeout_raw = _get(options, "timeout")
    try:
        timeout = float(timeout_raw) if timeout_raw not in (None, "") else 30.0
    except ValueError:
        raise OptionError(f"option 'timeout' must be a number of seconds, not {timeout_raw!r}")
    if timeout <= 0:
        raise OptionError("option 'timeout' must be > 0")

    return SourceOptions(
        path=path,
        urls=urls,
        store=store,
        logs=logs,
        logs_pattern=pattern,
        max_records_per_trigger=per_trigger,
        max_records_per_partition=_positive_int(
            options, "maxRecordsPerPartition", DEFAULT_MAX_RECORDS_PER_PARTITION),
        min_partitions=_positive_int(options, "minPartitions", 2),
        value_format=value_format,
        json_schema=json_schema,
        starting_offsets=starting or "earliest",
        ending_offsets=ending,
        fail_on_data_loss=_bool(options, "failOnDataLoss", True),
        timeout=timeout,
        arrow_batch_bytes=_positive_int(options, "arrowBatchBytes", DEFAULT_ARROW_BATCH_BYTES),
        arrow_batch_records=_positive_int(
            options, "arrowBatchRecords", DEFAULT_ARROW_BATCH_RECORDS),
        tls=parse_tls(options),
    )


def value_type_ddl(opts):
    """The DDL of the C{value} column for these options."""
    if opts.value_format == "binary":
        return "BINARY"
    if opts.value_format == "utf8":
        return "STRING"
    schema = opts.json_schema
    if schema.startswith("{"):
        # A StructType's JSON (df.schema.json()): turn it into DDL without the JVM.
        from pyspark.sql.types import StructType
        try:
            struct = StructType.fromJson(json.loads(schema))
        except Exception as e:
            raise OptionError(f"option 'jsonSchema' is not a valid StructType JSON: {e}")
        return struct.simpleString()
    return f"STRUCT<{schema}>"


def source_schema_ddl(opts):
    """
    The source's schema.  C{log} and C{position} are never null; C{value} is
    null only for a JSON record that does not parse.  Reading several
    styx-servers adds C{node} (the server's C{host:port}); reading a
    JetStream store adds C{timestamp} (the append time of the record's batch).
    """
    ddl = f"log STRING NOT NULL, position BIGINT NOT NULL, value {value_type_ddl(opts)}"
    if opts.fleet:
        ddl += ", node STRING NOT NULL"
    if opts.store is not None:
        # JetStream keeps the time each message (one batch) was stored: the
        # record's append time, as Kafka's LogAppendTime.  Other stores keep none.
        ddl += ", timestamp TIMESTAMP NOT NULL"
    return ddl


@dataclass(frozen=True)
class SinkOptions:
    url: str
    log: str
    protocol: str = "styx"
    batch_records: int = 10000
    batch_bytes: int = 1024 * 1024
    timeout: float = 30.0
    create_log: bool = True
    tls: TLSFiles | None = None


def parse_sink_options(options):
    check_known(options, SINK_OPTIONS, "write")
    urls = parse_urls(_get(options, "url"))
    if len(urls) != 1:
        raise OptionError("the sink needs exactly one styx-server base URL in option 'url'")
    log = _get(options, "log") or _get(options, "logs")
    if not log:
        raise OptionError("the sink needs the option 'log' (the log to append to)")
    log = str(log).strip()
    try:
        validate_name(log)
    except Exception as e:
        raise OptionError(f"option 'log': invalid log name {log!r}: {e}")
    protocol = str(_get(options, "protocol") or "styx").strip().lower()
    if protocol not in ("styx", "http"):
        raise OptionError(f"option 'protocol' must be styx or http, not {protocol!r}")
    timeout_raw = _get(options, "timeout")
    try:
        timeout = float(timeout_raw) if timeout_raw not in (None, "") else 30.0
    except ValueError:
        raise OptionError(f"option 'timeout' must be a number of seconds, not {timeout_raw!r}")
    return SinkOptions(
        url=urls[0],
        log=log,
        protocol=protocol,
        batch_records=_positive_int(options, "batchRecords", 10000),
        batch_bytes=_positive_int(options, "batchBytes", 1024 * 1024),
        timeout=timeout,
        create_log=_bool(options, "createLog", True),
        tls=parse_tls(options),
    )
