"""
The server side of the styx/0 upgrade, under the streams it starts
(L{streamproto.styx.stream}): whether a request asks for it, the
C{101 Switching Protocols} head (padded for Go's net/http), taking the
connection over from twisted.web, and refusing a stream the policy denies.
"""

from twisted.internet.protocol import Protocol
from twisted.web.server import NOT_DONE_YET

from streamproto.core.compat import (
    forget_requests, redirect_channel_input, replace_protocol, take_buffered_data,
)
from streamproto.core.tcp import max_segment_size
from streamproto.styx.codec import ErrorCode, encode_error

PROTOCOL_NAME = b"styx/0"
TIMEOUT_HEADER = b"X-Styx-Timeout"
#: The reference's default X-Styx-Timeout, in seconds.
DEFAULT_TIMEOUT = 30
#: Never announce less: the Go client heartbeats every remote-timeout/2 and
#: panics on a zero interval.
MIN_TIMEOUT = 2
#: Delay between the 101 and the first record sent to a consumer whose
#: client we do not know.  The Go client reads the 101 through net/http,
#: which keeps whatever arrived with the response in a buffer it never
#: hands over: records in the same TCP segment as the 101 would be lost to
#: it.
DEFAULT_CONSUMER_START_DELAY = 0.01
#: The User-Agent of L{streamproto.styx.stream_client}, which needs no delay.
OWN_CLIENT_AGENT = b"streamproto-styx"
#: The User-Agent of Go's net/http (the Go styx CLI and library).
GO_HTTP_AGENT = b"Go-http-client/"
#: What Go's net/http reads a response head with (C{Transport.ReadBufferSize}
#: by default): its first read takes at most this many bytes.  A 101 head
#: padded to exactly this size, arriving in one segment, is all that read
#: can take, so records may follow at once without a byte of them lost.
GO_HTTP_READ_BUFFER = 4096
_PADDING_HEADER = b"X-Styx-Padding: "


def _error_response(request, error):
    request.setResponseCode(error.status)
    request.setHeader(b"content-type", b"application/json")
    request.write(error.to_json())
    request.finish()
    return NOT_DONE_YET


def is_styx_upgrade(request):
    """Whether a twisted.web request asks for the styx/0 upgrade."""
    upgrade = request.getHeader(b"upgrade")
    return upgrade is not None and upgrade.strip().lower() == PROTOCOL_NAME


def _early_bytes(request):
    """Bytes the client sent after its request, before our 101: a request
    body, and whatever twisted.web buffered while the request was handled."""
    early = []
    content = getattr(request, "content", None)
    if content is not None:
        content.seek(0)
        body = content.read()
        if body:
            early.append(body)
    early.extend(take_buffered_data(request.channel))
    return b"".join(early)


def take_over(request, protocol):
    """
    Detach the request's connection from twisted.web and make C{protocol}
    its protocol (over TCP or TLS).  Bytes twisted.web still holds, or
    receives later in the same read, are handed to
    C{protocol.early_data_received}.

    @return: the transport.
    """
    channel = request.channel
    transport, channel.transport = channel.transport, None
    # the channel registered itself as the transport's producer
    transport.unregisterProducer()
    replace_protocol(transport, protocol)
    # if render ran from inside the channel's dataReceived, the rest of that
    # read is still in its line buffer and comes to rawDataReceived next
    redirect_channel_input(channel, protocol.early_data_received)
    # twisted.web is done with the request: no cycle left for the collector
    # (about 30 objects a connection, held until a full collection)
    forget_requests(channel)
    return transport


def switching_head(timeout, pad_to=0):
    """
    The C{101 Switching Protocols} head announcing C{timeout}.

    @param pad_to: if not 0, the head's exact length in bytes, made up by
        an C{X-Styx-Padding} header (see L{consumer_start}).
    """
    head = (b"HTTP/1.1 101 Switching Protocols\r\n"
            b"Upgrade: styx/0\r\n"
            b"Connection: Upgrade\r\n"
            b"X-Styx-Timeout: %d\r\n" % timeout)
    if pad_to:
        filler = pad_to - len(head) - len(_PADDING_HEADER) - 4
        if filler < 0:
            raise ValueError(f"a 101 head does not fit in {pad_to} bytes")
        head += _PADDING_HEADER + b"-" * filler + b"\r\n"
    return head + b"\r\n"


def consumer_start(request):
    """
    How a consumer stream starts for the client of C{request}: the delay
    before its first records and the length to pad the 101 head to.

    Our own client reads records that arrive with the 101: no delay.  Go's
    net/http (the Go styx client) reads the head with one 4 KiB read whose
    surplus it throws away; a head of exactly that size, arriving in one
    TCP segment (plain TCP with a maximum segment size of at least 4 KiB:
    loopback, jumbo frames), is all that read can take, so the records can
    follow at once.  Anyone else, and Go over smaller segments, gets the
    head and then, L{DEFAULT_CONSUMER_START_DELAY} later, the records.

    @return: C{(start_delay, pad_to)}.
    """
    agent = request.getHeader(b"user-agent") or b""
    if agent.startswith(OWN_CLIENT_AGENT):
        return 0, 0
    if agent.startswith(GO_HTTP_AGENT):
        mss = max_segment_size(request.channel.transport)
        if mss is not None and mss >= GO_HTTP_READ_BUFFER:
            return 0, GO_HTTP_READ_BUFFER
    return DEFAULT_CONSUMER_START_DELAY, 0


class _Refused(Protocol):
    """Sends one Error message and closes (what a denied stream gets)."""

    def __init__(self, code):
        self.code = code

    def connectionMade(self):
        self.transport.write(encode_error(self.code))
        self.transport.loseConnection()

    def early_data_received(self, data):
        pass  # a producer's records: dropped, nothing was acknowledged


def refuse(request, error, timeout=DEFAULT_TIMEOUT):
    """
    Deny a styx/0 upgrade request the stream's way: 101, then an Error
    message (C{UNAUTHORIZED} or C{FORBIDDEN} for the L{APIError} C{error}
    of the authorization policy), then close.  Nothing touched the log.

    @return: C{NOT_DONE_YET}.
    """
    if request.channel is None or request.channel.transport is None:
        return _error_response(request, error)
    code = ErrorCode.UNAUTHORIZED if error.code == "unauthorized" else ErrorCode.FORBIDDEN
    protocol = _Refused(code)
    _early_bytes(request)
    transport = take_over(request, protocol)
    transport.write(switching_head(max(MIN_TIMEOUT, int(timeout))))
    transport.resumeProducing()
    protocol.makeConnection(transport)
    return NOT_DONE_YET
