"""
The bounds and timers of a Relink link (L{LinkConfig}), shared by both
roles and by the channels that enforce them.
"""

from dataclasses import dataclass

from streamproto.relink import codec

#: bytes a received message counts for beyond its payload, so that a flood
#: of empty messages is bounded in memory too (its list and bytes objects)
MESSAGE_OVERHEAD = 64


@dataclass(frozen=True)
class LinkConfig:
    """
    Bounds and timers of a link (both ends should use the same window).

    @ivar window: most messages this end transmits before it sees them
        consumed, per channel (the send window).  The spec has no receive
        window: a peer may keep any number in flight, so a receiver never
        treats many unconsumed messages as an error; it stops reading
        instead (C{max_unconsumed}, C{max_buffered_bytes}).
    @ivar window_bytes: most payload bytes a sender has transmitted but not
        seen consumed, per channel (a message bigger than this is still
        transmitted, alone, so nothing deadlocks).  Channels with
        transactions are bounded by C{window} only: a transaction's messages
        stay unconsumed until its commit, which must get through.
    @ivar max_queued: messages accepted by C{send} beyond the window, per
        channel; beyond that C{send} fails with
        L{streamproto.relink.errors.ChannelBusy} (wait for
        L{streamproto.relink.channels.OutChannel.when_writable}).
    @ivar max_queued_bytes: payload bytes accepted by C{send} beyond
        C{window_bytes}, per channel (the batch that crosses it is still
        accepted whole).
    @ivar write_chunk_bytes: payload bytes written to the transport in one
        go before the link checks again whether the transport asked it to
        pause (it stops transmitting while the transport's buffer is full).
    @ivar max_channels: open channels per direction.
    @ivar max_buffered_bytes: unconsumed incoming bytes per link (payload
        plus L{MESSAGE_OVERHEAD} a message) before the connection stops
        reading (producer pause); it reads again below half of it.  Also the
        most bytes a transaction may stage before its commit (a commit behind
        a paused stream could never arrive: a bigger transaction is a
        protocol error, not a hang).
    @ivar shutdown_timeout: seconds a connector's
        L{streamproto.relink.api.Connector.shutdown} waits for the peer's
        shutdown and last acknowledgements before it gives up (the link is
        discarded, the Deferred fails with
        L{streamproto.relink.errors.LinkLost}).
    @ivar max_unconsumed: unconsumed incoming messages per channel before the
        connection stops reading; it reads again below half of it.  Also the
        most messages a transaction may stage before its commit.
    @ivar stall_timeout: seconds reading may stay paused with nothing
        consumed while one of our channels has a sender waiting for room
        (for the peer's acknowledgements, which wait unread behind the
        peer's data) and the peer reads what we send.  Then the connection
        is dropped and the link kept: on the resumption the peer sends its
        acknowledgements first (spec 3.5), which breaks the wait.  0 turns
        this off.
    """
    window: int = 4096
    window_bytes: int = 4 * 1024 * 1024
    max_queued: int = 4096
    max_queued_bytes: int = 4 * 1024 * 1024
    write_chunk_bytes: int = 1024 * 1024
    max_channels: int = 1024
    max_buffered_bytes: int = 32 * 1024 * 1024
    max_unconsumed: int = 262144
    stall_timeout: float = 0.5
    shutdown_timeout: float = 30.0
    ping_interval: float = 11.0
    pong_timeout: float = 7.0
    handshake_timeout: float = 10.0
    link_timeout: float = 60.0
    max_links: int = 10000
    limits: codec.Limits = codec.DEFAULT_LIMITS


__all__ = ["MESSAGE_OVERHEAD", "LinkConfig"]
