"""
The open-files limit (C{RLIMIT_NOFILE}) of a server process, raised at
start-up.

Why: every connection is a file descriptor, and so are a log's open
segment and index files.  Distributions start processes with a soft limit
of 1024 (for C{select()}'s sake) below a hard limit of 500,000 or more; a
server left at 1024 refuses its 1,000-odd connection with C{EMFILE}
("Too many open files") whatever the machine could hold.  Raising the soft
limit up to the hard one needs no privilege; beyond it, an operator raises
the hard limit (systemd's C{LimitNOFILE=}, C{ulimit -Hn}): see
doc/operations.rst.  Twisted's default reactor on Linux is epoll, which has
no 1024 ceiling.
"""

from __future__ import annotations

import resource
from typing import Any

#: what the kernel allows when the hard limit says "infinity" (Linux's
#: default fs.nr_open)
NR_OPEN_DEFAULT = 1 << 20


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return NR_OPEN_DEFAULT


def raise_open_files_limit(rlimit: Any = resource) -> tuple[int, int]:
    """
    Raise this process's soft C{RLIMIT_NOFILE} to its hard limit (capped
    at what the kernel allows).

    @param rlimit: what has C{getrlimit}, C{setrlimit}, C{RLIMIT_NOFILE},
        C{RLIM_INFINITY} (the C{resource} module; a fake in tests).
    @return: (the soft limit before, the soft limit now): equal when it
        could not, or need not, be raised.
    """
    soft, hard = rlimit.getrlimit(rlimit.RLIMIT_NOFILE)
    target = _nr_open() if hard == rlimit.RLIM_INFINITY else hard
    if soft != rlimit.RLIM_INFINITY and soft < target:
        try:
            rlimit.setrlimit(rlimit.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            return soft, soft
        return soft, target
    return soft, soft
