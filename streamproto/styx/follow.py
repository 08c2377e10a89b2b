"""
A cursor that reads a log from a position and follows it: what the styx/0
consumer stream (L{streamproto.styx.stream.ConsumerStream}) and the
WebSocket consumer (L{streamproto.styx.websocket.ConsumeProtocol}) share.

It knows nothing of the wire: it hands whole batches of records to its
owner's C{deliver}, and tells it when the reading is over (C{end}: the
count reached, or the synced end of the log when not following) or failed
(C{failed}).  Nothing here depends on Styx: only the L{ILog} interface.
"""

from twisted.internet.interfaces import IPushProducer
from zope.interface import implementer

#: The default bound of one read, in bytes.
DEFAULT_READ_BYTES = 1024 * 1024


@implementer(IPushProducer)
class LogFollower:
    """
    Read the log from C{position}: at most C{count} records (-1: no limit),
    waiting at its synced end for the fsync that makes more visible when
    C{follow} (L{ILog.wait}: no polling), or ending there otherwise.

    At most one batch is read ahead: while paused (the owner's transport is
    full) the follower holds that batch and reads nothing more, so a slow
    reader never makes the server buffer the log.  A push producer: an
    owner may register it with its transport directly, or call
    L{pauseProducing}/L{resumeProducing} itself.

    @ivar position: the next record to read.
    @ivar remaining: records still to read; -1: no limit.
    @ivar delivered: records handed to C{deliver} so far.
    @ivar stopped: no more calls to the owner will come.
    """

    def __init__(self, log, position, count=-1, follow=False, read_bytes=DEFAULT_READ_BYTES,
                 deliver=None, end=None, failed=None):
        """
        @param deliver: called with each L{RecordBatch} (never empty), in
            order, only while not paused.
        @param end: called (no argument) once every record asked for was
            delivered, or at the end of the log when not following.
        @param failed: called with the L{Failure} of a read or a wait.
        """
        self.log = log
        self.position = position
        self.remaining = count
        self.follow = follow
        self.read_bytes = read_bytes
        self.delivered = 0
        self._deliver = deliver
        self._end = end
        self._failed_callback = failed
        self.paused = False
        self.started = False
        self.stopped = False
        self._busy = False          # a log.read or log.wait is in flight
        self._ready = None          # a batch read ahead, not yet delivered
        self._at_end = False        # read to the end and not following
        self._wait = None
        self._in_pump = False

    def start(self):
        """Begin reading (and delivering unless paused)."""
        self.started = True
        self.pump()

    def stop(self):
        """Stop for good: no more reads, deliveries or calls; a wait in
        flight is cancelled."""
        self.stopped = True
        if self._wait is not None:
            wait, self._wait = self._wait, None
            wait.addErrback(lambda f: None)
            wait.cancel()

    # IPushProducer
    def pauseProducing(self):
        self.paused = True

    def resumeProducing(self):
        self.paused = False
        self.pump()

    def stopProducing(self):
        self.stop()

    def pump(self):
        """
        Deliver the batch read ahead unless paused, keep one batch read
        ahead, end at the end.  A loop rather than recursion: reads may
        complete synchronously (their callbacks call back in here).
        """
        if self._in_pump:
            return
        self._in_pump = True
        try:
            while self.started and not self.stopped:
                if self._ready is not None:
                    if self.paused:
                        return
                    batch, self._ready = self._ready, None
                    self.delivered += len(batch)
                    self._deliver(batch)
                    continue
                if self._busy:
                    return
                if self.remaining == 0 or self._at_end:
                    self.stopped = True
                    self._end()
                    return
                self._busy = True
                max_records = self.remaining if self.remaining > 0 else -1
                self.log.read(self.position, max_records, self.read_bytes).addCallbacks(
                    self._got, self._failed)
        finally:
            self._in_pump = False

    def _got(self, batch):
        self._busy = False
        if self.stopped:
            return
        n = len(batch)
        if n:
            self.position = batch.next_position
            if self.remaining > 0:
                self.remaining -= n
            self._ready = batch
        elif not self.follow:
            self._at_end = True
        else:
            # at the synced end: woken by the fsync that makes more visible
            self._busy = True
            self._wait = self.log.wait(self.position)
            self._wait.addCallbacks(self._woken, self._failed)
            return
        self.pump()

    def _woken(self, _end_position):
        self._wait = None
        self._busy = False
        self.pump()

    def _failed(self, failure):
        self._busy = False
        self._wait = None
        if self.stopped:
            return None
        # a read is only started with nothing read ahead, and a wait only
        # after an empty read: there is never a batch left undelivered here
        self.stopped = True
        self._failed_callback(failure)
        return None
