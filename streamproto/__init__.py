"""streamproto: a Twisted protocol suite for reliable record streaming."""

__version__ = "0.1.0"
