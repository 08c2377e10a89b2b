"""
Is the cluster run so that an acknowledgement means durable?  Checked once
at start-up by the store (L{risks}), each risk a warning naming what is
lost and the setting that avoids it (doc/scale-out.rst, "Selecting the
store" and "What survives which failure").

Two settings decide it, and the client protocol shows only one:

 - stream replicas: a stream of one replica is lost, acknowledged records
   and all, with its node's disk; with two, one node down stops appends
   (no quorum) and each acknowledgement rests on two copies.  Seen in
   the store's own C{replicas} and in each existing log's stream config
   (C{$JS.API.STREAM.LIST}).
 - C{sync_interval}: nats-server's default (2 minutes) acknowledges
   writes the nodes have not fsynced; a power loss of the nodes at once
   (a rack, a zone, a data centre) loses them on every replica.  Only a
   server's monitoring endpoint (C{/varz}: C{jetstream.config.sync_always})
   shows it; C{$JS.API.INFO} and the connection's INFO do not.  So it is
   checked only when the store URL names the endpoints (C{?monitor=}).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterable
from typing import Any

from streamproto.log.natsio import NatsIO

#: stream replicas below this lose acknowledged records with one node's disk
SAFE_REPLICAS = 3


def replica_risks(replicas: int, streams: Iterable[tuple[str, int]]) -> list[str]:
    """
    @param replicas: the replicas of the logs the store creates.
    @param streams: C{(stream name, num_replicas)} of the existing logs.
    """
    risks = []
    if replicas < SAFE_REPLICAS:
        risks.append(
            f"logs created here get {replicas} replica(s) (replicas={replicas}): the loss of "
            f"one node's disk loses acknowledged records{'' if replicas > 1 else ' for good'}"
            f"; use ?replicas=3 on a cluster of 3 or more nodes")
    few = sorted(name for name, n in streams if n < SAFE_REPLICAS)
    if few:
        shown = ", ".join(few[:5]) + (f" and {len(few) - 5} more" if len(few) > 5 else "")
        risks.append(
            f"{len(few)} existing log stream(s) have fewer than {SAFE_REPLICAS} replicas "
            f"({shown}): the loss of one node's disk loses their acknowledged records; raise "
            f"num_replicas (nats stream edit --replicas 3)")
    return risks


def sync_risks(varz: dict[str, dict[str, Any]]) -> list[str]:
    """
    @param varz: monitoring URL -> that server's C{/varz} document.
    """
    lazy = []
    for url, doc in sorted(varz.items()):
        config = (doc.get("jetstream") or {}).get("config") or {}
        if not config.get("sync_always"):
            interval = config.get("sync_interval")
            every = f"every {interval / 1e9:g} s" if isinstance(interval, (int, float)) \
                else "on its own schedule"
            lazy.append(f"{doc.get('server_name') or url} (fsync {every})")
    if not lazy:
        return []
    return [f"nats-server {', '.join(lazy)} acknowledges writes before fsyncing them: a "
            f"power loss of the nodes at once loses acknowledged records on every replica; "
            f"set sync_interval: always in each node's jetstream block"]


def _fetch(url: str, timeout: float) -> dict[str, Any]:
    with urllib.request.urlopen(url.rstrip("/") + "/varz", timeout=timeout) as response:
        doc: dict[str, Any] = json.loads(response.read())
    return doc


async def risks(io: NatsIO, prefix: str, replicas: int, monitor: Iterable[str],
                timeout: float = 3.0) -> list[str]:
    """
    Every risk this store's cluster runs, as warning texts (on the asyncio
    side: C{io} is connected).  What cannot be checked is said too.
    """
    streams: list[tuple[str, int]] = []
    found: list[str] = []
    offset = 0
    try:
        while True:
            page = await io.api("STREAM.LIST", {"subject": f"{prefix}.>", "offset": offset})
            entries = page.get("streams") or []
            for entry in entries:
                config = entry.get("config") or {}
                streams.append((config.get("name", "?"), int(config.get("num_replicas", 1))))
            offset += len(entries)
            if not entries or offset >= int(page.get("total", 0)):
                break
    except Exception as e:   # noqa: BLE001 - a check that fails warns, never stops the store
        found.append(f"the existing logs' replicas could not be read: {e}")
    found[:0] = replica_risks(replicas, streams)
    varz: dict[str, dict[str, Any]] = {}
    for url in monitor:
        try:
            varz[url] = await asyncio.get_running_loop().run_in_executor(
                None, _fetch, url, timeout)
        except (OSError, ValueError) as e:
            found.append(f"{url}/varz cannot be read ({e}): sync_interval not checked")
    return found + sync_risks(varz)
