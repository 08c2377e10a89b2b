"""
What the streams carry, apart from how they are carried.

Stateful mode: the application state of a session is C{{"count", "value",
"crc"}}; L{next_message} is the pure transformer handed to
L{ISessionStore.put}: it draws the next value from the npm mersenne-twister
chain, rolls the CRC-32 and returns the message data and the new state.

Stateless mode: an L{IStatelessSequence} makes the endless stream of big
integers from nothing (L{IStatelessSequence.start}) or resumes it knowing only
the last value.  L{DoublingSequence} is the reference's: a random start in
1..255, then each value doubles the previous one.
"""

import decimal
import random
import re
import struct
import zlib

from zope.interface import Interface, implementer

from streamproto.reliable.errors import ProtocolError
from streamproto.reliable.mt19937 import first_random_int

_pack_u32 = struct.Struct(">I").pack


class StreamFinished(Exception):
    """put() was asked for a message past the last one of the stream."""


def update_crc(crc, value):
    """Rolling CRC-32 of C{value} as a big-endian uint32 (the spec's rule)."""
    return zlib.crc32(_pack_u32(value), crc)


def initial_state(count, seed=None, rng=random):
    """The state a new stateful session starts from (the spec's register())."""
    if seed is None:
        seed = rng.getrandbits(32)
    return {"count": count, "value": seed, "crc": 0}


def next_message(state):
    """
    The stateful transformer: C{state -> (data, new_state)}, pure.  The last
    message of the stream (count reaches 0) carries the CRC.
    """
    count = state["count"]
    if count <= 0:
        raise StreamFinished("the stream is complete")
    value = first_random_int(state["value"])
    crc = zlib.crc32(_pack_u32(value), state["crc"])
    data = {"value": value, "crc": crc} if count == 1 else {"value": value}
    return data, {"count": count - 1, "value": value, "crc": crc}


class IStatelessSequence(Interface):
    """An endless sequence of non-negative integers, as decimal strings."""

    def start():
        """A cursor at the beginning of a new stream."""

    def resume(last):
        """
        A cursor positioned after C{last} (a decimal string of a value the
        stream sent).  Raises L{ProtocolError} if C{last} cannot be a value of
        this stream.
        """

    def take(cursor, n):
        """C{(values, cursor)}: the next C{n} values (decimal strings) and the new cursor."""


_DECIMAL_DIGITS = re.compile(r"[0-9]+\Z")
# Exact integer arithmetic of any size: decimal avoids int -> str conversion,
# which is quadratic and capped at 4300 digits by default for ints.
_EXACT = decimal.Context(prec=decimal.MAX_PREC, Emax=decimal.MAX_EMAX, traps=[decimal.Inexact])


@implementer(IStatelessSequence)
class DoublingSequence:
    """
    The reference stream: a random start in 1..255 (sent itself), then each
    value is twice the previous one.  Resuming from "23" gives 46, 92, 184.
    """

    def __init__(self, rng=random):
        self._rng = rng

    def start(self):
        return ("first", self._rng.randint(1, 255))

    def resume(self, last):
        if not isinstance(last, str) or not _DECIMAL_DIGITS.match(last):
            raise ProtocolError("state must be a decimal string")
        value = decimal.Decimal(last)
        if value == 0:
            raise ProtocolError("state is not a value of this stream")
        return ("after", value)

    def take(self, cursor, n):
        kind, value = cursor
        value = decimal.Decimal(value)
        out = []
        if kind == "first":
            out.append(str(value))
            n -= 1
        add = _EXACT.add
        for _ in range(n):
            value = add(value, value)
            out.append(str(value))
        return out, ("after", value)
