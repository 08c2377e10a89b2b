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


#: Kafka's position codes in C{startingOffsets} / C{endingOffsets} JSON.
EARLIEST = -2
LATEST = -1

#: Every read option, spelled as documented (Spark lower-cases the keys).
SOURCE_OPTIONS = (
    "path", "url", "logs", "log", "logsPattern", "valueFormat", "jsonSchema",
    "startingPosition", "startingOffsets", "endingOffsets",
    "maxRecordsPerTrigger", "maxOffsetsPerTrigger", "maxRecordsPerPartition", "minPartitions",
    "failOnDataLoss", "timeout", "arrowBatchBytes", "arrowBatchRecords",
    "caCerts", "certificate", "privateKey",
)

#: Every write option.
SINK_OPTIONS = (
    "url", "log", "logs", "protocol", "batchRecords", "batchBytes", "timeout", "createLog",
    "caCerts", "certificate", "privateKey",
)

#: Keys that Spark itself puts in a Python data source's options, found with
#: a probe source on pyspark 4.3: C{load(p)}, C{save(p)} and C{start(p)} add
#: C{path}; a stream writer also gets C{checkpointLocation} and, after
#: C{queryName(...)}, C{queryName}.  They must never be refused.
SPARK_OPTIONS = ("path", "checkpointLocation", "queryName")

#: Kafka source options with another name here, for the error message.
KAFKA_HINTS = {
    "subscribe": "logs",
    "assign": "logs (with startingOffsets/endingOffsets per log)",
    "subscribePattern": "logsPattern",
    "kafka.bootstrap.servers": "url or path",
    "minOffsetsPerTrigger": None,
    "maxTriggerDelay": None,
    "includeHeaders": None,
    "startingTimestamp": None,
    "startingOffsetsByTimestamp": None,
    "endingTimestamp": None,
    "endingOffsetsByTimestamp": None,
    "groupIdPrefix": None,
    "kafkaConsumer.pollTimeoutMs": "timeout",
    "fetchOffset.numRetries": None,
    "fetchOffset.retryIntervalMs": None,
}


def check_known(options, known, what="read"):
    """
    @raise OptionError: for an option that is not in C{known} (nor one that
        Spark sets itself), naming it and the closest known spelling.
    """
    canonical = {k.lower(): k for k in tuple(known) + SPARK_OPTIONS}
    hints = {k.lower(): (k, v) for k, v in KAFKA_HINTS.items()}
    for key in options:
        lowered = str(key).lower()
        if lowered in canonical:
            continue
        message = f"unknown {what} option {key!r}"
        if lowered in hints:
            kafka, ours = hints[lowered]
            message += (f": Kafka's {kafka!r} is {ours!r} here" if ours else
                        f": Kafka's {kafka!r} has no equivalent here (see doc/spark.rst)")
        else:
            close = difflib.get_close_matches(lowered, list(canonical), n=1, cutoff=0.6)
            if close:
                message += f" (did you mean {canonical[close[0]]!r}?)"
        raise OptionError(message + f"; {what} options: {', '.join(sorted(known, key=str.lower))}")


@dataclass(frozen=True)
class SourceOptions:
    """
    Where and how to read.

    @ivar path: a local log store directory (readable on every executor), or None.
    @ivar urls: a tuple of styx-server base URLs (without trailing slash), or ().
        With a C{path}, one URL: the server that owns that directory, asked
        for the logs' synced ends while the records are read from the files.
    @ivar logs: a tuple of log names, or None for every log (or every log
        whose name matches C{logs_pattern}).
    @ivar logs_pattern: a regular expression (a string) the whole log name
        must match, or None.
    @ivar starting_offsets: C{"earliest"}, C{"latest"} or C{{log: position}}
        (a position, or L{EARLIEST} / L{LATEST}); logs not named start at
        their earliest record.
    @ivar ending_offsets: C{"latest"} or C{{log: position or LATEST}} (batch
        reads only: an exclusive end); logs not named end at their latest.
    """

    path: str | None = None
    urls: tuple = ()
    logs: tuple | None = None
    logs_pattern: str | None = None
    max_records_per_trigger: int | None = None
    max_records_per_partition: int = DEFAULT_MAX_RECORDS_PER_PARTITION
    min_partitions: int = 2
    value_format: str = "binary"
    json_schema: str | None = None
    starting_offsets: object = "earliest"
    ending_offsets: object = "latest"
    fail_on_data_loss: bool = True
    timeout: float = 30.0
    arrow_batch_bytes: int = DEFAULT_ARROW_BATCH_BYTES
    arrow_batch_records: int = DEFAULT_ARROW_BATCH_RECORDS
    tls: TLSFiles | None = None


def _get(options, key):
    # Spark hands a case-insensitive dict; plain dicts in tests may not be.
    if key in options:
        return options[key]
    lowered = {k.lower(): v for k, v in options.items()}
    return lowered.get(key.lower())


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


def parse_offsets(key, raw, ending=False):
    """
    C{startingOffsets} / C{endingOffsets}: C{earliest}, C{latest}, or a JSON
    object C{{"log": position}} where a position is a record position (>= 0),
    C{-2} (earliest) or C{-1} (latest), as Kafka spells them; Kafka's
    per-partition form C{{"log": {"0": position}}} is taken too (our logs
    have one partition, C{"0"}).

    @return: C{"earliest"}, C{"latest"} or a dict log -> int.
    """
    text = str(raw).strip()
    if text.lower() in ("earliest", "latest"):
        if ending and text.lower() == "earliest":
            raise OptionError(f"option {key!r} cannot be earliest (an end before every record)")
        return text.lower()
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise OptionError(f"option {key!r} must be earliest, latest or a JSON object "
                          f"{{\"log\": position}}, not {text!r}")
    offsets = {}
    for log, position in parsed.items():
        try:
            validate_name(log)
        except Exception as e:
            raise OptionError(f"option {key!r}: invalid log name {log!r}: {e}")
        if isinstance(position, dict):
            if set(position) != {"0"}:
                raise OptionError(f"option {key!r}: log {log!r} has one partition, \"0\", "
                                  f"not {sorted(position)}")
            position = position["0"]
        if isinstance(position, bool) or not isinstance(position, int) or position < EARLIEST:
            raise OptionError(f"option {key!r}: the position of log {log!r} must be an integer "
                              f">= 0, or -2 (earliest) or -1 (latest), not {position!r}")
        if ending and position == EARLIEST:
            raise OptionError(f"option {key!r}: log {log!r} cannot end at -2 (earliest)")
        offsets[log] = position
    return offsets


def parse_source_options(options):
    """
    @param options: the (case-insensitive) options dict Spark gives the data source.
    @return: a L{SourceOptions}.
    @raise OptionError: for a missing, unknown or invalid option.
    """
    check_known(options, SOURCE_OPTIONS, "read")
    path = _get(options, "path")
    path = str(path) if path not in (None, "") else None
    urls = parse_urls(_get(options, "url"))
    if path is None and not urls:
        raise OptionError("give the option 'path' (a local log store directory) or 'url' "
                          "(styx-server base URLs, comma-separated), or both (the ends of the "
                          "logs from the server, the records from its directory)")
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
    pattern = _get(options, "logsPattern")
    if pattern is not None:
        if logs is not None:
            raise OptionError("give 'logs' (names) or 'logsPattern' (a regular expression), "
                              "not both")
        pattern = str(pattern)
        try:
            re.compile(pattern)
        except re.error as e:
            raise OptionError(f"option 'logsPattern' is not a regular expression: {e}")

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

    starting = _get(options, "startingOffsets")
    position = _get(options, "startingPosition")
    if starting is not None and position is not None:
        raise OptionError("give 'startingOffsets' or 'startingPosition' (the older spelling), "
                          "not both")
    if position is not None:
        starting = str(position).strip().lower()
        if starting not in ("earliest", "latest"):
            raise OptionError(f"option 'startingPosition' must be earliest or latest, "
                              f"not {starting!r}")
    elif starting is not None:
        starting = parse_offsets("startingOffsets", starting)
    else:
        starting = "earliest"
    ending = _get(options, "endingOffsets")
    ending = "latest" if ending is None else parse_offsets("endingOffsets", ending, ending=True)
    for key, offsets in (("startingOffsets", starting), ("endingOffsets", ending)):
        if isinstance(offsets, dict):
            for log in offsets:
                if logs is not None and log not in logs:
                    raise OptionError(f"option {key!r} names the log {log!r}, which is not "
                                      "in 'logs'")
                if pattern is not None and not re.fullmatch(pattern, log):
                    raise OptionError(f"option {key!r} names the log {log!r}, which does "
                                      "not match 'logsPattern'")

    per_trigger = _positive_int(options, "maxRecordsPerTrigger", None)
    kafka_per_trigger = _positive_int(options, "maxOffsetsPerTrigger", None)
    if per_trigger is not None and kafka_per_trigger is not None:
        raise OptionError("give 'maxRecordsPerTrigger' or 'maxOffsetsPerTrigger' (Kafka's "
                          "name for it), not both")
    if per_trigger is None:
        per_trigger = kafka_per_trigger

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
        logs=logs,
        logs_pattern=pattern,
        max_records_per_trigger=per_trigger,
        max_records_per_partition=_positive_int(
            options, "maxRecordsPerPartition", DEFAULT_MAX_RECORDS_PER_PARTITION),
        min_partitions=_positive_int(options, "minPartitions", 2),
        value_format=value_format,
        json_schema=json_schema,
        starting_offsets=starting,
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
    null only for a JSON record that does not parse.
    """
    return f"log STRING NOT NULL, position BIGINT NOT NULL, value {value_type_ddl(opts)}"


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


def check_batch_read(opts):
    """
    What a batch read refuses (as Kafka's source does): a start at the
    latest record, which would read nothing.

    @raise OptionError: if C{opts} cannot be a batch read.
    """
    starting = opts.starting_offsets
    if starting == "latest":
        raise OptionError("a batch read cannot start at 'latest' (it would read nothing): "
                          "use earliest or positions in 'startingOffsets'")
    if isinstance(starting, dict):
        for log, position in starting.items():
            if position == LATEST:
                raise OptionError(f"option 'startingOffsets': a batch read cannot start log "
                                  f"{log!r} at -1 (latest)")


def check_stream_read(opts):
    """
    @raise OptionError: if C{opts} cannot be a streaming read: a stream has
        no end (C{endingOffsets} is for batch reads, as with Kafka).
    """
    if opts.ending_offsets != "latest":
        raise OptionError("option 'endingOffsets' only applies to batch reads (spark.read); "
                          "a stream has no end")


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
