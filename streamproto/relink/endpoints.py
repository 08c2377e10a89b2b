"""
The endpoints the relink server hosts.

- C{echo}: every message is sent back on the same channel (for testing peers).
- C{log} / C{log-tx}: a bridge to the log store.  Messages on channel N are
  appended to the log named by the template (C{{channel}} is replaced by N);
  a message's parts are concatenated into one record.  Without transactions
  (C{log}) a batch is acknowledged consumed once its append is durable; with
  connector transactions (C{log-tx}) a commit appends all its messages in one
  C{append} (atomic) and is acknowledged committed once durable.
"""

from twisted.internet.defer import Deferred, fail, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from streamproto.core import metrics
from streamproto.core.auth import ALLOW_ALL, ANONYMOUS, AuthorizationDenied, denied
from streamproto.core.errors import log_failure
from streamproto.relink.api import SERVER_NAME, ChannelHandler, IChannelHandler, RelinkEndpoint
from streamproto.relink.config import LinkConfig
from streamproto.relink.errors import LinkError
from streamproto.log.public import PublicLogStore

DEFAULT_LOG_TEMPLATE = "relink-{channel}"


def _answer_shutdown(link):
    """
    Our half of the shutdown the peer started.  A link discarded before it
    completes (the peer went away for good, the server stops) has nothing
    left to report: that is no error to log.
    """
    link.shutdown().addErrback(lambda f: f.trap(LinkError))


@implementer(IChannelHandler)
class EchoHandler(ChannelHandler):
    """
    Sends each message back on the channel with the same id.  A batch is
    consumed once the echo is accepted into our send window, so a peer that
    does not consume our echoes is slowed down rather than buffered.
    """

    log = Logger()

    def __init__(self, server_name=SERVER_NAME):
        self._queues = {}   # (link, channel) -> [(messages, Deferred)] waiting for room
        self._records_out = metrics.ServerMetrics(server_name).records_out

    def messages_received(self, link, channel_id, messages):
        key = (link, channel_id)
        queue = self._queues.get(key)
        if queue is None:
            if link.channel(channel_id).room >= len(messages):
                self._echo(link, channel_id, messages)
                return None
            queue = self._queues[key] = []
        d = Deferred()
        queue.append((list(messages), d))
        if len(queue) == 1:
            self._drain(key)
        return d

    def _drain(self, key):
        link, channel_id = key
        queue = self._queues[key]
        try:
            channel = link.channel(channel_id)
            while queue:
                messages, d = queue[0]
                room = channel.room
                if room <= 0:
                    channel.when_writable().addCallbacks(lambda _: self._drain(key),
                                                         lambda f: self._fail(key, f))
                    return
                chunk, messages[:] = messages[:room], messages[room:]
                self._echo(link, channel_id, chunk)
                if not messages:
                    queue.pop(0)
                    d.callback(None)
        except LinkError:
            self._fail(key, Failure())
            return
        del self._queues[key]

    def _fail(self, key, failure):
        for _, d in self._queues.pop(key, []):
            d.errback(failure)

    def peer_shutdown(self, link):
        # we only ever answer on the peer's channels: shut down with it
        _answer_shutdown(link)

    def _echo(self, link, channel_id, messages):
        channel = link.channel(channel_id)
        channel.send_many(messages, ack=None)
        self._records_out.inc(len(messages))
        if channel.transactional:
            channel.commit().addErrback(lambda f: f.trap(LinkError))

    def commit_received(self, link, channel_id, messages):
        if messages:
            self.messages_received(link, channel_id, messages)
        return True


@implementer(IChannelHandler)
class LogBridgeHandler(ChannelHandler):
    """Appends what arrives on channel N to the log C{template.format(channel=N)}."""

    log = Logger()

    def __init__(self, store, template=DEFAULT_LOG_TEMPLATE, server_name=SERVER_NAME,
                 authorizer=ALLOW_ALL):
        self.store = store
        self.server_name = server_name
        #: who may append to which log (the link's principals, write)
        self.authorizer = authorizer
        self._records_in = metrics.ServerMetrics(server_name).records_in
        self.template = template
        self._logs = {}
        self._opening = {}

    def _log(self, channel_id):
        name = self.template.format(channel=channel_id)
        log = self._logs.get(name)
        if log is not None:
            return succeed(log)
        d = Deferred()
        waiters = self._opening.get(name)
        if waiters is None:
            # one open per log; waiters fire in arrival order, so appends
            # from consecutive batches stay in order
            waiters = self._opening[name] = [d]

            def opened(log):
                self._logs[name] = log
                for w in self._opening.pop(name):
                    w.callback(log)

            def failed(f):
                for w in self._opening.pop(name):
                    w.errback(f)

            self.store.get_or_create(name).addCallbacks(opened, failed)
        else:
            waiters.append(d)
        return d

    def peer_shutdown(self, link):
        _answer_shutdown(link)

    def _append(self, channel_id, records):
        def forget(f):
            # a deleted or failed log is reopened next time (or fails again)
            self._logs.pop(self.template.format(channel=channel_id), None)
            return f

        def stored(result):
            self._records_in.inc(len(records))
            return result

        return self._log(channel_id).addCallback(
            lambda log: log.append(records)).addCallbacks(stored, forget)

    def _denied(self, link, channel_id):
        """
        None if the link's principals may write channel C{channel_id}'s
        log, else a failed Deferred: the link is discarded, nothing of it
        stored or acknowledged.
        """
        if not self.authorizer.enabled:
            return None
        name = self.template.format(channel=channel_id)
        principals = getattr(link, "principals", None) or (ANONYMOUS,)
        if self.authorizer.allows(principals, "write", name):
            return None
        denied(self.server_name, principals, "write", name, f"link {link.link_id} discarded")
        return fail(AuthorizationDenied(f"write to log {name!r} denied"))

    def link_denied(self, principals):
        """
        Why a link of C{principals} may not be made, when that is known at
        the handshake: every channel goes to one log (a template without
        C{{channel}}) that they may not write.  None otherwise.
        """
        if not self.authorizer.enabled or "{channel}" in self.template:
            return None
        name = self.template.format(channel=0)
        if self.authorizer.allows(principals, "write", name):
            return None
        denied(self.server_name, principals, "write", name, "handshake ended")
        return f"write to log {name!r}"

    def messages_received(self, link, channel_id, messages):
        refused = self._denied(link, channel_id)
        if refused is not None:
            return refused
        records = [m[0] if len(m) == 1 else b"".join(m) for m in messages]
        return self._append(channel_id, records)

    def commit_received(self, link, channel_id, messages):
        if not messages:
            return True
        refused = self._denied(link, channel_id)
        if refused is not None:
            return refused
        records = [m[0] if len(m) == 1 else b"".join(m) for m in messages]

        def failed(f):
            # the store's own refusals (no quorum...) are one line, a bug a traceback
            log_failure(self.log, f, "relink log bridge: commit on channel {channel} failed",
                        channel=channel_id)
            return False

        return self._append(channel_id, records).addCallbacks(lambda _: True, failed)


#: the server's send window (the echoes), in messages per channel.  Peers
#: acknowledge in batches: the Go package sends its acks every 16,384
#: consumed messages or after 100 ms, so a window of 4,096 left the echo
#: waiting 100 ms per 4,096 messages (41k messages/s); 65,536 is the Go
#: package's own window.  The server never sends transactions, so a large
#: window costs only what C{window_bytes} allows in flight.
SERVER_WINDOW = 65536


def server_config(**kwargs):
    """The L{LinkConfig} of the server's endpoints: the defaults, with L{SERVER_WINDOW}."""
    kwargs.setdefault("window", SERVER_WINDOW)
    return LinkConfig(**kwargs)


def server_endpoints(store, template=DEFAULT_LOG_TEMPLATE, id_size=4, config=None,
                     clock=None, authorizer=ALLOW_ALL):
    """
    The server's endpoints: C{echo}, C{log} and C{log-tx} (connector
    transactions), each with C{id_size}-byte channel ids both ways.

    @param config: a L{LinkConfig}; default L{server_config}C{()}.
    """
    if config is None:
        config = server_config()
    # the users' logs only: never a write into the servers' internal state
    bridge = LogBridgeHandler(PublicLogStore(store), template, authorizer=authorizer)
    common = dict(connector_id_size=id_size, listener_id_size=id_size, config=config,
                  clock=clock)
    return [
        RelinkEndpoint("echo", EchoHandler(), **common),
        RelinkEndpoint("log", bridge, **common),
        RelinkEndpoint("log-tx", bridge, connector_transactions=True, **common),
    ]
