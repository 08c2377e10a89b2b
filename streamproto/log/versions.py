"""
The versions of the on-disk formats, in one place, and the one refusal of
a format newer than this release reads.

Every durable format says which version it is:

- file store segments: the last byte of L{format.SEGMENT_MAGIC}
  (L{SEGMENT_VERSION});
- a file store log's C{config.json} and C{state.json}: the key C{format}
  (absent: 1; L{LOG_FILES_VERSION});
- segment indexes (C{.idx}): none, on purpose: an index is a cache, one
  that does not decode is rebuilt from its segment;
- a JetStream log: the stream's metadata C{streamproto_format}
  (L{JETSTREAM_VERSION}); its messages' headers are that version's;
- the Pravega controller's document: the key C{format} (absent: 1;
  L{CONTROLLER_VERSION});
- reliable-stream sessions: SQLite's C{user_version} (0 and 1: today's)
  and the JetStream bucket entries' C{format} key (absent: 1).

A release reads every version up to its own and refuses a newer one with
L{NewerFormat}: one line naming the file (or stream) and both versions.
A change of format bumps the constant here, keeps reading the older
versions, and regenerates the fixture that every later release opens
(C{test/fixtures/make_formats.py}, doc/logstore.rst).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from streamproto.log.errors import LogError

SEGMENT_VERSION = 1
LOG_FILES_VERSION = 1
JETSTREAM_VERSION = 1
CONTROLLER_VERSION = 1
SESSION_VERSION = 1


class NewerFormat(LogError):
    """Data written by a newer release, in a format this one does not read."""

    code = "log_not_available"


def check(what: str, found: object, known: int) -> None:
    """
    @param found: the version the data says (an int, or its text).
    @raise NewerFormat: C{found} is above C{known} (or not a version at all).
    """
    try:
        version = int(str(found))
    except ValueError:
        version = -1
    if version > known or version < 0:
        from streamproto import __version__
        raise NewerFormat(
            f"{what} is in format version {found}; streamproto {__version__} reads up to "
            f"version {known}: run the release that wrote it (or a newer one), or copy the "
            "data to a store this release reads with that release's `streamproto store copy`")


def check_mapping(what: str, document: Mapping[str, Any], known: int) -> None:
    """L{check} on the C{format} key of a JSON document (absent: version 1)."""
    check(what, document.get("format", 1), known)
