"""
What the authorization policy costs: the matcher alone (rules in the
policy vs. decisions per second), and Styx HTTP requests (single-record
produce, log info) with no policy as the baseline and with a policy of
N rules, in the same run, server and client in this one process.

    python bench/auth_bench.py [--requests N] [--rules R]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.benchenv import measured  # noqa: E402
measured()   # which streamproto and path this measures (bench/benchenv.py)

from twisted.internet import defer, task  # noqa: E402
from twisted.web.client import HTTPConnectionPool  # noqa: E402

from streamproto.core.auth import ALLOW_ALL, Policy  # noqa: E402
from streamproto.log import MemoryLogStore  # noqa: E402
from streamproto.styx.api_client import StyxClient  # noqa: E402
from streamproto.styx.resource import make_site  # noqa: E402


def policy(rules):
    """C{rules} rules for other certificates, then the one that matches (the worst case)."""
    text = "".join(f'[[allow]]\nprincipal = "cn:client-{i}"\nlogs = ["logs-{i}-*", "x{i}"]\n'
                   'ops = ["read", "write"]\n' for i in range(rules - 1))
    text += '[[allow]]\nprincipal = "*"\nlogs = ["bench*"]\nops = ["read", "write", "admin"]\n'
    return Policy.from_toml(text)


def matcher(rules, n=100_000):
    """Decisions per second: new ones (each resource once), then remembered ones."""
    p = policy(rules)
    principals = ("cn:someone", "san:someone.example.org")
    names = [f"bench-{i}" for i in range(n)]
    t = time.perf_counter()
    for name in names:
        p._decide(principals, "write", name)
    first = n / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(n):
        p.allows(principals, "write", "bench-1")
    again = n / (time.perf_counter() - t)
    print(f"Policy, {rules:>4} rules (glob match in the last): {first:>10,.0f} new decisions/s"
          f", {again:>10,.0f} remembered/s", flush=True)


@defer.inlineCallbacks
def http(reactor, authorizer, n):
    store = MemoryLogStore(reactor)
    port = reactor.listenTCP(0, make_site(store, authorizer=authorizer), interface="127.0.0.1")
    pool = HTTPConnectionPool(reactor, persistent=True)
    client = StyxClient(f"http://127.0.0.1:{port.getHost().port}", reactor, pool=pool)
    rates = {}
    try:
        yield client.create_log("bench")
        t = time.perf_counter()
        for _ in range(n):
            yield client.write_record("bench", b"x" * 100)
        rates["produce"] = n / (time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(n):
            yield client.get_log("bench")
        rates["info"] = n / (time.perf_counter() - t)
    finally:
        yield pool.closeCachedConnections()
        yield port.stopListening()
        yield store.close()
    return rates


@defer.inlineCallbacks
def run(reactor, args):
    for rules in (1, 10, 100, 1000):
        matcher(rules)
    base = yield http(reactor, ALLOW_ALL, args.requests)
    with_policy = yield http(reactor, policy(args.rules), args.requests)
    for kind, label in (("produce", "single-record produce"), ("info", "GET /logs/NAME")):
        print(f"HTTP {label:<24} no policy {base[kind]:>8,.0f} req/s, "
              f"{args.rules} rules {with_policy[kind]:>8,.0f} req/s "
              f"(x{with_policy[kind] / base[kind]:.2f})", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rules", type=int, default=100)
    args = parser.parse_args()
    task.react(run, [args])


if __name__ == "__main__":
    main()
