"""
Sans-IO codec of the reliable-stream protocol: bytes in, messages out, and
messages to bytes.  Pure: no Twisted, no clock, no I/O.

Framing is one JSON object per line (LF; a CR before it is JSON whitespace),
UTF-8.  Lines are bounded (L{LineDecoder}); anything that is not a valid
message raises L{ProtocolError} (or its subclass L{LineTooLong}) and nothing
else, whatever the bytes.  Unknown fields are ignored, as the spec asks.
"""

import json
from typing import NamedTuple

from streamproto.reliable.errors import LineTooLong, ProtocolError

#: default bound of one line, both directions.  Stateless values grow by one
#: bit a message, so a stateless stream can be resumed up to about 3.4 million
#: messages in with this bound; raise it for longer stateless streams.
DEFAULT_MAX_LINE = 1 << 20

MAX_COUNT = 0xFFFF
MAX_ID = 0xFFFFFFFF
MAX_UUID_LENGTH = 128


class LineDecoder:
    """
    Split a byte stream into lines without the LF.  Keeps one bytearray and
    remembers how far it has scanned, so a long line arriving in many pieces
    is scanned once, and complete lines are cut out with one deletion per
    L{feed}.
    """

    def __init__(self, max_line=DEFAULT_MAX_LINE):
        self.max_line = max_line
        self._buffer = bytearray()
        self._scanned = 0

    def feed(self, data):
        """The complete lines in the buffered bytes plus C{data}."""
        buffer = self._buffer
        buffer += data
        lines = []
        start = 0
        search_from = self._scanned
        max_line = self.max_line
        while True:
            end = buffer.find(b"\n", search_from)
            if end < 0:
                break
            if end - start > max_line:
                raise LineTooLong(f"line longer than {max_line} bytes")
            lines.append(bytes(buffer[start:end]))
            start = search_from = end + 1
        if start:
            del buffer[:start]
        self._scanned = len(buffer)
        if len(buffer) > max_line:
            raise LineTooLong(f"line longer than {max_line} bytes")
        return lines

    @property
    def buffered(self):
        return len(self._buffer)


def _reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def decode_object(line):
    """
    The JSON object on C{line} (bytes, UTF-8).  Everything that is not one
    (bad UTF-8, bad JSON, NaN, nesting deep enough to hit the recursion
    limit, integers too long to convert) is a L{ProtocolError}.
    """
    try:
        text = line.decode("utf-8")
        value = json.loads(text, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"invalid JSON: {e.__class__.__name__}") from None
    if not isinstance(value, dict):
        raise ProtocolError("a message must be a JSON object")
    return value


def is_blank(line):
    """Empty lines (and lone CRs) between messages are skipped, not errors."""
    return not line.strip()


def _integer(message, field, low, high):
    value = message[field]
    # bool is an int subclass in Python; JSON true is not a number
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(f"{field} must be an integer in {low}..{high}")
    return value


def _uuid(message):
    value = message["uuid"]
    if not isinstance(value, str) or not 0 < len(value) <= MAX_UUID_LENGTH:
        raise ProtocolError(f"uuid must be a string of 1..{MAX_UUID_LENGTH} characters")
    return value


# Client -> server messages


class StatelessStart(NamedTuple):
    """C{{}}: a new stateless stream."""


class StatelessResume(NamedTuple):
    """C{{"state": "<last value>"}}."""
    state: str


class StatefulOpen(NamedTuple):
    """C{{"uuid", "params": {"count"}}}: a new stateful session."""
    uuid: str
    count: int


class StatefulResume(NamedTuple):
    """C{{"uuid", "state": id}}: resume after message C{last_id} (0: from the start)."""
    uuid: str
    last_id: int


class Ack(NamedTuple):
    """C{{"uuid", "ack": id}}: every message up to C{message_id} arrived."""
    uuid: str
    message_id: int


def parse_client_message(line):
    """
    One client line -> one of L{StatelessStart}, L{StatelessResume},
    L{StatefulOpen}, L{StatefulResume}, L{Ack}.  Whether it is allowed at
    this point of the conversation is the server's business.
    """
    message = decode_object(line)
    if "uuid" in message:
        uuid = _uuid(message)
        if "state" in message:
            return StatefulResume(uuid, _integer(message, "state", 0, MAX_ID))
        if "params" in message:
            params = message["params"]
            if not isinstance(params, dict) or "count" not in params:
                raise ProtocolError("params must be an object with a count")
            return StatefulOpen(uuid, _integer(params, "count", 1, MAX_COUNT))
        if "ack" in message:
            return Ack(uuid, _integer(message, "ack", 0, MAX_ID))
        raise ProtocolError("a message with a uuid needs params, state or ack")
    if "state" in message:
        state = message["state"]
        if not isinstance(state, str):
            raise ProtocolError("state must be a decimal string")
        return StatelessResume(state)
    return StatelessStart()


def encode_stateless_start():
    return b"{}\n"


def encode_stateless_resume(state):
    return json.dumps({"state": state}).encode() + b"\n"


def encode_open(uuid, count):
    return json.dumps({"uuid": uuid, "params": {"count": count}}).encode() + b"\n"


def encode_resume(uuid, last_id):
    return json.dumps({"uuid": uuid, "state": last_id}).encode() + b"\n"


def encode_ack(uuid, message_id):
    return json.dumps({"uuid": uuid, "ack": message_id}).encode() + b"\n"


# Server -> client messages


class ErrorMessage(NamedTuple):
    """C{{"error": text}}."""
    text: str


class StatelessValue(NamedTuple):
    """C{{"data": "<decimal>"}}."""
    value: str


class StatefulMessage(NamedTuple):
    """C{{"id", "data": {"value"[, "crc"]}}}; C{crc} is None but on the last one."""
    message_id: int
    value: int
    crc: int | None


#: the error line a stopping server sends every connection (the session
#: stays resumable: clients reconnect and resume, as after a drop)
SHUTDOWN_ERROR = "server shutting down"


def encode_error(text):
    return json.dumps({"error": str(text)}).encode() + b"\n"


def encode_stateless_values(values):
    """Lines for several stateless values (decimal strings) at once."""
    return "".join(['{"data":"%s"}\n' % v for v in values]).encode("ascii")


def encode_stateful(message_id, data):
    """
    One stateful message.  The data of this application is C{{"value"[, "crc"]}};
    that shape is formatted directly (it is the hot path), anything else
    through json.
    """
    if type(data) is dict:
        value = data.get("value")
        if type(value) is int:
            if len(data) == 1:
                return b'{"id":%d,"data":{"value":%d}}\n' % (message_id, value)
            crc = data.get("crc")
            if len(data) == 2 and type(crc) is int:
                return b'{"id":%d,"data":{"value":%d,"crc":%d}}\n' % (message_id, value, crc)
    return json.dumps({"id": message_id, "data": data}, separators=(",", ":")).encode() + b"\n"


def parse_server_message(line, stateful):
    """One server line -> L{ErrorMessage}, L{StatelessValue} or L{StatefulMessage}."""
    message = decode_object(line)
    if "error" in message:
        return ErrorMessage(str(message["error"]))
    if "data" not in message:
        raise ProtocolError("a server message needs data or error")
    data = message["data"]
    if not stateful:
        if not isinstance(data, str) or not data.isascii() or not data.isdigit():
            raise ProtocolError("stateless data must be a decimal string")
        return StatelessValue(data)
    if not isinstance(data, dict) or "value" not in data or "id" not in message:
        raise ProtocolError("stateful messages need an id and data.value")
    crc = _integer(data, "crc", 0, MAX_ID) if "crc" in data else None
    return StatefulMessage(_integer(message, "id", 0, MAX_ID),
                           _integer(data, "value", 0, MAX_ID), crc)
