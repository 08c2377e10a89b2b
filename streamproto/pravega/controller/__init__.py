"""
A single-node Pravega Controller: the gRPC C{ControllerService} clients ask
for scopes, streams, segments and segment-store addresses before they talk
to the segment store.

Streams and their segments
==========================
Creating a stream with I{n} segments creates C{scope/stream/K.#epoch.0}
(K < n, equal key ranges) on our segment store.  A segment id is
C{creation epoch << 32 | number}, as the clients compute it.  A manual
C{scale} seals some active segments and creates successors covering exactly
their key ranges, with the next segment numbers, in a new epoch; the
clients find them through C{getSegmentsImmediatelyFollowing}.
C{truncateStream} truncates the segments of a stream cut at its offsets and
deletes every segment before the cut; C{getSegments} then answers the cut as
the stream's head.  C{getSegmentsBetween} lists the segments between two
cuts and C{isStreamCutValid} checks one.  C{updateStream} records the
configuration (it does not scale: use C{scale}).  Retention policies (SIZE,
TIME) are enforced by periodic rounds (L{ControllerState.apply_retention})
that record stream cuts at the segments' tails and truncate at the newest
one the policy lets go, through the same durable path as C{truncateStream}.
C{getURI} answers every segment (also reader-group table segments) with
this server's segment-store address.  Auto-scaling, consumption-based
retention, reader-group and key-value-table RPCs are not implemented: gRPC
answers the RPCs UNIMPLEMENTED.

grpcio runs handlers on its own thread pool.  L{ControllerState} lives on
the reactor thread (it uses the log store); each handler hands its request
to it with C{blockingCallFromThread} and waits, so the reactor never blocks
and all store access stays on the reactor thread.

The state (scopes, stream layouts, transactions) is one JSON document; every
change appends the whole document to the log C{pravega-controller} and is
answered only once that append is durable.  Opening replays the last record
and finishes what a crash interrupted (a scale, a truncation, a commit).

Modules
=======
- L{layout}: segment names and ids, the pure L{Layout} of a stream's
  segments, and the retention policy helpers (no I/O);
- L{state}: the durable L{ControllerState};
- L{servicer}: the gRPC handlers, L{ControllerServicer};
- L{service}: L{ControllerService} (the Twisted service running the gRPC
  server), its TLS and L{parse_controller_endpoint}.

The names other modules use are importable from this package.
"""

import os

# gRPC's fork support (on by default in grpcio's core) re-creates its
# pollers in a forked child; a Twisted process that spawns a child
# (spawnProcess forks, closes every descriptor, then execs) then sees the
# child die on "epoll_wait error: Bad file descriptor" before its exec.
# Read when grpc is first imported (lazily, in the submodules: importing
# any of them runs this first); an explicit setting wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

from streamproto.pravega.controller.layout import (  # noqa: E402
    KEY_EPSILON, MAX_EPOCHS, MAX_SEGMENTS, Layout, choose_retention_cut, name_of,
    retention_policy, segment_id, segment_name, txn_name_of, txn_segment_name,
)
from streamproto.pravega.controller.service import (  # noqa: E402
    ControllerService, ControllerTLS, parse_controller_endpoint,
)
from streamproto.pravega.controller.servicer import (  # noqa: E402
    SERVER_LABEL, SERVICE_NAME, ControllerServicer,
)
from streamproto.pravega.controller.state import (  # noqa: E402
    DEFAULT_LEASE_MS, MAX_COMPLETED_TXNS, MAX_LEASE_MS, MAX_RETENTION_CUTS, MUTATION_ATTEMPTS,
    STATE_LOG, ControllerState, ControllerStateDamaged,
)

__all__ = [
    "DEFAULT_LEASE_MS", "KEY_EPSILON", "MAX_COMPLETED_TXNS", "MAX_EPOCHS", "MAX_LEASE_MS",
    "MAX_RETENTION_CUTS", "MAX_SEGMENTS", "MUTATION_ATTEMPTS", "SERVER_LABEL", "SERVICE_NAME",
    "STATE_LOG", "ControllerService", "ControllerServicer", "ControllerState",
    "ControllerStateDamaged", "ControllerTLS", "Layout", "choose_retention_cut", "name_of",
    "parse_controller_endpoint", "retention_policy", "segment_id", "segment_name",
    "txn_name_of", "txn_segment_name",
]
