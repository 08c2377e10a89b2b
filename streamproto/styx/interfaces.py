"""
What the produce side of the HTTP API (L{streamproto.styx.produce}) asks
of the resource it appends for: declared here, under both, so that the
request class finds the API's resource by L{Interface.providedBy} instead
of importing the router that imports it (doc/architecture.rst).
"""

from zope.interface import Attribute, Interface

__all__ = ["IProduceTarget"]


class IProduceTarget(Interface):
    """
    The Styx API resource a site serves, seen by its request class: where a
    streamed produce appends (L{streamproto.styx.resource.StyxResource}).
    """

    store = Attribute(
        "The L{streamproto.log.interfaces.ILogStore} appended to (the public "
        "view: internal logs are not part of the API).")
    metrics = Attribute(
        "The L{streamproto.styx.metrics.StyxMetrics} counting what is produced.")
    authorizer = Attribute(
        "The L{streamproto.core.auth.IAuthorizer} the API applies.")

    def cors_headers(origin: str | None) -> list[tuple[bytes, bytes]]:
        """
        The CORS headers of an answer to a request from C{origin} (None
        without an Origin header).
        """
