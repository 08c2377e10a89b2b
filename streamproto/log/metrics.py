"""
The Prometheus metrics the file store counts itself: fsyncs, group
commits, retention.  Defined here, under the core kit, because the store
observes them on its own paths; L{streamproto.core.metrics} names them
with the rest of the suite's metrics.
"""

from prometheus_client import Counter, Histogram

__all__ = ["FSYNC_SECONDS", "GROUP_COMMIT_APPENDS", "RETENTION_DELETIONS"]

FSYNC_SECONDS = Histogram(
    "streamproto_fsync_seconds", "Duration of log store fsyncs.",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
GROUP_COMMIT_APPENDS = Histogram(
    "streamproto_group_commit_appends", "Appends acknowledged by one fsync.",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024))
RETENTION_DELETIONS = Counter(
    "streamproto_retention_deleted_segments", "Segments deleted by retention or truncation.")
