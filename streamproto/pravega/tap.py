"""C{twistd pravega-server}: the Pravega segment store on the shared log store."""

from twisted.python import usage

from streamproto.core.tap import ServerOptions, positive_int, server_service
from streamproto.pravega.codec import MAX_FRAME_SIZE
from streamproto.pravega.server import PravegaServerFactory


def _non_negative_float(name):
    def coerce(value):
        try:
            v = float(value)
        except ValueError:
            raise ValueError(f"{name} must be a number")
        if v < 0:
            raise ValueError(f"{name} must not be negative")
        return v
    coerce.coerceDoc = "Seconds (a number >= 0)."
    return coerce


class Options(ServerOptions):
    """Options of the Pravega segment-store server."""

    defaultPort = "tcp:12345"
    optParameters = [
        ["read-wait", None, 60.0, "Seconds a ReadSegment at the tail waits for data.",
         _non_negative_float("read-wait")],
        ["max-frame-size", None, MAX_FRAME_SIZE, "Largest frame accepted (bytes).",
         positive_int("max-frame-size")],
        ["max-outstanding", None, 32 * 1024 * 1024,
         "Unacknowledged append bytes per connection before reading from it pauses.",
         positive_int("max-outstanding")],
        ["idle-timeout", None, 300.0,
         "Seconds of silence before an idle connection is closed (0: never).",
         _non_negative_float("idle-timeout")],
    ]

    def postOptions(self):
        super().postOptions()
        if self["max-frame-size"] > MAX_FRAME_SIZE:
            raise usage.UsageError(f"--max-frame-size must be at most {MAX_FRAME_SIZE}")


def makeService(options, store=None):
    def factory(store):
        return PravegaServerFactory(
            store, read_wait=options["read-wait"], max_frame_size=options["max-frame-size"],
            max_outstanding_bytes=options["max-outstanding"],
            idle_timeout=options["idle-timeout"])
    return server_service(options, factory, store, name="pravega")
