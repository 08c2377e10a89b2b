"""What an append reports once durable."""

from typing import NamedTuple


class AppendResult(NamedTuple):
    """
    @ivar first_position: position of the first appended record.
    @ivar end_position: synced end position of the log when the append was
        acknowledged (>= first_position + number of records).
    @ivar end_offset: synced end in payload bytes at that moment.
    """

    first_position: int
    end_position: int
    end_offset: int
