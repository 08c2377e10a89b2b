"""
A network of our own for partitions: one Linux network namespace per
member (a nats-server node, the front-end and its clients), each joined by
a veth pair to a router namespace (the "switch"), with iproute2 only.

Why a router and not a bridge: a partition must be a silent drop in the
network, between any two members, in either direction, as a cut cable or a
dead switch port is (Jepsen drops with iptables).  This kernel has no netem
and the machine no nftables/iptables; but a router forwards by the policy
rules of its namespace, and C{ip rule add from A to B blackhole} there drops
A's packets to B without a word to either side (no ICMP, no reset): the
sender's TCP retransmits into the void until its own timeouts fire.  A
flapping link is the router's end of a member's veth set down and up.

Member C{i} has 10.99.C{i+1}.2/24 on its C{eth0}, the router 10.99.C{i+1}.1
on C{r<i>} (the member's default route).  The addresses exist only inside
namespaces made here: the host's interfaces and routes are never touched,
so every fabric can use the same subnet.  Namespaces are named
C{faults-<pid>-<n>-<member>}; L{Fabric.teardown} deletes them, and
L{remove_stale} those of harness processes that are gone (a run killed
with SIGKILL).

The harness reaches the members from its own process through
L{Fabric.call}: a function run in a thread that has joined the router's
namespace (C{setns(2)} is per thread for network namespaces), so its
sockets are the router's, which routes to every member (its policy rules
match forwarded packets only).  Processes run in a member's namespace
through L{Fabric.prefix} (C{nsenter --net}, which execs: the pid is the
process's own, for kill and SIGSTOP).
"""

import ctypes
import itertools
import os
import shutil
import subprocess
import threading

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"
SUBNET = "10.99"

_counter = itertools.count()
_lock = threading.Lock()
#: fabrics built and not torn down yet (for an interrupted run's cleanup)
LIVE = set()


def _ip(*args, check=True):
    result = subprocess.run(["ip", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def unavailable():
    """Why network namespaces cannot be made here, or C{None} when they can."""
    if shutil.which("ip") is None:
        return "no ip command (Debian package iproute2)"
    if shutil.which("nsenter") is None:
        return "no nsenter command (Debian package util-linux)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    name = f"faults-{os.getpid()}-probe"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _setns(path):
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({path}): {os.strerror(errno)}")
    finally:
        os.close(fd)


def _namespaces():
    return os.listdir(NETNS_DIR) if os.path.isdir(NETNS_DIR) else []


def remove_stale():
    """Delete the namespaces of harness processes that no longer exist."""
    for name in _namespaces():
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == "faults" and parts[1].isdigit() \
                and not os.path.exists(f"/proc/{parts[1]}"):
            _ip("netns", "del", name, check=False)


def ours():
    """The namespaces this process made and did not delete yet."""
    return [n for n in _namespaces() if n.startswith(f"faults-{os.getpid()}-")]


class Fabric:
    """
    Members in namespaces of their own, joined by a router namespace.

    @param members: the members' names (short words: C{fe}, C{n0}...).
    """

    def __init__(self, members):
        self.members = list(members)
        with _lock:
            self.tag = f"faults-{os.getpid()}-{next(_counter)}"
        self.router = f"{self.tag}-router"
        self.blocked = set()       # (from, to) pairs dropped by the router
        self.down = set()          # members whose link is down
        self.built = False

    def ns(self, member):
        return f"{self.tag}-{member}"

    def index(self, member):
        return self.members.index(member) + 1

    def address(self, member):
        return f"{SUBNET}.{self.index(member)}.2"

    def prefix(self, member):
        """
        The argv prefix that runs a command in C{member}'s namespace.
        C{nsenter}, not C{ip netns exec}: that one also gives the command a
        mount namespace of its own, whose copies of the lazy FS mounts keep
        them busy after the harness unmounts them.
        """
        return [shutil.which("nsenter") or "nsenter",
                f"--net={os.path.join(NETNS_DIR, self.ns(member))}", "--"]

    def build(self):
        LIVE.add(self)
        self.built = True
        try:
            _ip("netns", "add", self.router)
            _ip("-n", self.router, "link", "set", "lo", "up")
            _ip("netns", "exec", self.router, "sh", "-c",
                "echo 1 > /proc/sys/net/ipv4/ip_forward")
            for member in self.members:
                i = self.index(member)
                ns = self.ns(member)
                _ip("netns", "add", ns)
                _ip("-n", self.router, "link", "add", f"r{i}", "type", "veth", "peer", "name",
                    "eth0", "netns", ns)
                _ip("-n", self.router, "addr", "add", f"{SUBNET}.{i}.1/24", "dev", f"r{i}")
                _ip("-n", self.router, "link", "set", f"r{i}", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{SUBNET}.{i}.2/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "route", "add", "default", "via", f"{SUBNET}.{i}.1")
        except Exception:
            self.teardown()
            raise
        return self

    # -- faults ----------------------------------------------------------

    def block(self, a, b):
        """Drop what C{a} sends to C{b} (one direction)."""
        if (a, b) not in self.blocked:
            _ip("-n", self.router, "rule", "add", "from", self.address(a), "to",
                self.address(b), "blackhole")
            self.blocked.add((a, b))

    def cut(self, side_a, side_b):
        """Drop everything between the members of C{side_a} and those of C{side_b}."""
        for a in side_a:
            for b in side_b:
                self.block(a, b)
                self.block(b, a)

    def link(self, member, up):
        """Set C{member}'s link (its router end) up or down: a flap."""
        _ip("-n", self.router, "link", "set", f"r{self.index(member)}", "up" if up else "down")
        (self.down.discard if up else self.down.add)(member)

    def heal(self):
        """Every rule removed, every link up."""
        for a, b in sorted(self.blocked):
            _ip("-n", self.router, "rule", "del", "from", self.address(a), "to",
                self.address(b), "blackhole", check=False)
        self.blocked.clear()
        for member in sorted(self.down):
            self.link(member, True)

    # -- the harness's own access ---------------------------------------

    def call(self, function, *args, member=None):
        """
        C{function(*args)} in the calling thread, moved into the router's
        namespace (or C{member}'s) for the call (its sockets are made
        there), then back.  Call it from a thread of the pool or of its
        own, never from the reactor's.
        """
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            _setns(os.path.join(NETNS_DIR, self.router if member is None else self.ns(member)))
            try:
                return function(*args)
            finally:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(own, CLONE_NEWNET) != 0:
                    # a pool thread left in the wrong namespace would be a
                    # silent bug for every later user: stop here
                    os._exit(70)
        finally:
            os.close(own)

    def teardown(self):
        """Delete every namespace of this fabric (the veths go with them)."""
        for member in self.members:
            _ip("netns", "del", self.ns(member), check=False)
        _ip("netns", "del", self.router, check=False)
        self.blocked.clear()
        self.down.clear()
        LIVE.discard(self)
