"""
The errors a Relink link reports to its users (through the Deferreds of
L{streamproto.relink.link.Link} and its channels).
"""


class LinkError(Exception):
    """Base of the errors a link reports to its users."""


class LinkLost(LinkError):
    """The link state was discarded (new link id or epoch, protocol error, shutdown)."""


class ChannelBusy(LinkError):
    """The channel's window and queue are full: wait for C{when_writable()}."""


class ChannelClosing(LinkError):
    """The channel is being closed; it can be reopened once the close is acknowledged."""


class CommitOutcomeUnknown(LinkError):
    """Acknowledgements of this commit were lost with a connection and cannot be told apart."""


__all__ = ["ChannelBusy", "ChannelClosing", "CommitOutcomeUnknown", "LinkError", "LinkLost"]
