"""
L{JetStreamLogStore}: the log store on a replicated NATS JetStream cluster.

The same L{ILogStore}/L{ILog} as the file store, so every server runs on
it unchanged, and several front-ends on one cluster serve the same logs.
How a log is laid out in a stream is in L{streamproto.log.natsformat};
how messages are found by position in L{streamproto.log.msgindex}; the
NATS client runs on its own asyncio loop (L{streamproto.log.natsio},
L{streamproto.log.bridge}).  Everything here runs on the reactor thread.

Appends: one chain per log
    Appends are queued in order and sent as messages, several small appends
    merged into one message and a large one split (at most
    C{max_message_bytes} each), one message in flight per log: what is
    appended while it waits goes out merged in the next.  Each message
    carries the positions it was given and one expectation,
    C{Nats-Expected-Last-Sequence}, the sequence of the last message the
    log knows is stored: the stream leader checks it before it proposes,
    and the replicas apply an entry only at the sequence the leader
    proposed it for.  So a message is stored only right after the message
    its positions were computed from: positions stay contiguous even with
    several front-ends appending to one log.  (Two messages in flight would
    break that: the second's expectation names a sequence another
    front-end's message can fill after the first was refused; the chain
    module says more.)  An append is acknowledged once JetStream
    acknowledged every message holding it, i.e. once the quorum stored
    them, and never because of another message's acknowledgement.

Fail-stop, then recovery from the quorum
    On any error or timeout the chain stops: nothing sent after the failure
    is acknowledged until the log has re-read the authoritative tail of the
    stream from the leader (and the followers' headers between), learning
    which of its messages were stored after all (by message id).  Records of
    messages that were not stored are sent again with fresh positions;
    another front-end's append winning the race is just that.  While the
    tail cannot be read (no quorum) appends wait; once that lasts longer than
    C{timeout} seconds the log reports C{failed} and appends fail at once
    with L{LogFailed}, never hang, never ack, until the cluster answers again.

Reads
    Readers see only what JetStream acknowledged: reads go to the stream
    leader, which serves committed messages only.  Bodies of recent messages
    (this front-end's own appends, and what readers fetched) stay in a cache
    bounded in bytes, so followers of a busy log read from memory.

Followers
    Each open log has a watcher: an ordered push consumer delivering the
    headers of every new message, so L{ILog.wait} fires without polling when
    another front-end appends.  C{get()} of an open log also asks the leader
    for the tail, so a record acknowledged through any front-end is readable
    through this one as soon as C{get()} returns.

Modules
=======
One module per concern; the log delegates to one object per side:

- L{store}: L{JetStreamLogStore}, the cluster and the logs on it
  (connecting, advisories, create/open/delete, retention rounds);
- L{log}: L{JetStreamLog}, one log: its acknowledged state, how it is
  learnt (recovery, the follower, catching up with the leader), and the
  L{ILog} methods, which hand the work to
- L{chain}: L{AppendChain}, the write side (merging and splitting appends
  into messages, the messages in flight, the resynchronisation after an
  error, deadlines);
- L{reading}: L{MessageReader}, the read side (finding a message by
  position or offset, the body cache, read-ahead);
- L{truncation}: L{Truncation}, where the log starts (markers, purges,
  retention);
- L{common}: what they share (the translation of the cluster's errors).

The names other modules import (L{JetStreamLogStore}, L{JetStreamLog}) are
importable from this package.
"""

from streamproto.log.jetstream.log import JetStreamLog
from streamproto.log.jetstream.store import JetStreamLogStore

__all__ = ["JetStreamLog", "JetStreamLogStore"]
