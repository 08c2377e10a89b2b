"""
Reading a server endpoint string without listening on it: the one parser
for what Twisted's C{serverFromString} would be given (C{tcp:7123:
interface=127.0.0.1}, C{ssl:...}, our C{mtls:...}), where we need its
parts ourselves (the address a Pravega segment store advertises, the
gRPC controller's listener, which is not a Twisted one).

Twisted's own splitter is private (C{twisted.internet.endpoints._parse});
this follows the same rules: fields separated by C{:}, a backslash makes
the next character literal (C{\\:}), C{key=value} fields are options.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["EndpointDescription", "parse_endpoint", "split_fields"]


def split_fields(description: str) -> list[str]:
    """Split at C{:} as Twisted endpoint strings do (C{\\:} is a literal colon)."""
    parts: list[str] = []
    current: list[str] = []
    chars = iter(description)
    for c in chars:
        if c == "\\":
            current.append(next(chars, ""))
        elif c == ":":
            parts.append("".join(current))
            current = []
        else:
            current.append(c)
    parts.append("".join(current))
    return parts


@dataclass(frozen=True)
class EndpointDescription:
    """
    An endpoint string's parts.

    @ivar kind: C{tcp}, C{ssl}, C{mtls}, C{unix}, ...
    @ivar args: the positional fields after the kind (a port, a path).
    @ivar options: the C{key=value} fields.
    """

    kind: str
    args: tuple[str, ...] = ()
    options: dict[str, str] = field(default_factory=dict)

    @property
    def port(self) -> int | None:
        """The port of a C{tcp}/C{ssl}/C{tls}/C{mtls} endpoint (its first field), else None."""
        value = self.args[0] if self.args else self.options.get("port", "")
        if self.kind in ("tcp", "ssl", "tls", "mtls") and value.isdigit():
            return int(value)
        return None

    @property
    def interface(self) -> str | None:
        """The C{interface=} option, or None (every interface)."""
        return self.options.get("interface")


def parse_endpoint(description: str) -> EndpointDescription:
    """
    @return: the parts of C{description}.
    @raise ValueError: when it has no kind.
    """
    fields = split_fields(description)
    kind = fields[0]
    if not kind:
        raise ValueError(f"not an endpoint description: {description!r}")
    args: list[str] = []
    options: dict[str, str] = {}
    for item in fields[1:]:
        key, sep, value = item.partition("=")
        if sep:
            options[key] = value
        else:
            args.append(item)
    return EndpointDescription(kind, tuple(args), options)
