"""
The nemesis: faults injected into real processes on a seeded schedule.

A fault class (L{FAULTS}) acts on a target (L{test.faults.targets}: the
servers, the lazy filesystems under their data, the client process) through
the few verbs a target offers: processes to kill or pause, a power cut, a
clock to jump.  The schedule (L{Nemesis}) draws every choice from one
C{random.Random(seed)}: which fault, which process, how long, when; so a
run is reproduced by its seed (up to the timing of the machine).

A fault a target cannot take here says why (L{Fault.unavailable}); the
harness reports it in the results, never skips it silently.
"""

import signal
import time

from twisted.internet import defer, task


def sleep(reactor, seconds):
    return task.deferLater(reactor, seconds, lambda: None)


class Fault:
    """One class of fault: C{name}, C{unavailable(target)}, C{inject(...)}."""

    name = "fault"

    def unavailable(self, target):
        """Why this target cannot take the fault here, or C{None}."""
        return None

    def inject(self, reactor, rng, target):
        """Inject one fault; fires with a one-line description once healed."""
        raise NotImplementedError


class Kill9(Fault):
    """SIGKILL one server process, restart it after a short outage."""

    name = "kill9"

    @defer.inlineCallbacks
    def inject(self, reactor, rng, target):
        victim = rng.choice(target.killable())
        down = rng.uniform(0.1, 1.0)
        yield target.kill(victim)
        yield sleep(reactor, down)
        yield target.start(victim)
        return f"kill -9 {victim}, down {down:.2f} s"


class PowerLoss(Fault):
    """
    A power cut: SIGKILL the processes on a disk and drop everything the
    disk had not fsynced (the lazy FS), then power back on.
    """

    name = "powerloss"

    def unavailable(self, target):
        return target.lazy_unavailable()

    @defer.inlineCallbacks
    def inject(self, reactor, rng, target):
        disks = target.disks()
        chosen = disks if rng.random() < 0.3 else [rng.choice(disks)]
        down = rng.uniform(0.1, 0.5)
        answers = yield target.power_cut(chosen)
        yield sleep(reactor, down)
        yield target.power_on(chosen)
        return f"power loss of {'+'.join(chosen)} ({'; '.join(answers)})"


class Pause(Fault):
    """SIGSTOP a process for longer than the clients' timeouts, then SIGCONT."""

    name = "pause"

    def __init__(self, low=2.0, high=8.0):
        self.low, self.high = low, high

    @defer.inlineCallbacks
    def inject(self, reactor, rng, target):
        victim = rng.choice(target.pausable())
        length = rng.uniform(self.low, self.high)
        target.signal(victim, signal.SIGSTOP)
        try:
            yield sleep(reactor, length)
        finally:
            target.signal(victim, signal.SIGCONT)
        return f"SIGSTOP {victim} for {length:.2f} s"


class ClockJump(Fault):
    """Jump a front-end's wall clock forward or back (libfaketime), then back to true."""

    name = "clock"

    def unavailable(self, target):
        return target.clock_unavailable()

    @defer.inlineCallbacks
    def inject(self, reactor, rng, target):
        offset = rng.choice([-1, 1]) * rng.uniform(30, 3600)
        hold = rng.uniform(1.0, 4.0)
        target.set_clock(offset)
        try:
            yield sleep(reactor, hold)
        finally:
            target.set_clock(0)
        return f"clock {offset:+.0f} s for {hold:.2f} s"


class NodeClockJump(Fault):
    """
    Jump a cluster node's wall clock (not the front-end's): which nothing
    here can do, so the target only says why (L{node_clock_unavailable}).
    """

    name = "nodeclock"

    def unavailable(self, target):
        return target.node_clock_unavailable()

    def inject(self, reactor, rng, target):
        raise AssertionError("no target can jump a node's clock here")


class Partition(Fault):
    """
    Cut the network (L{test.faults.netns}: silent drops at the router
    between namespaces) one of the target's ways, drawn by the target
    (the front-end from the cluster, the stream leader from the other
    nodes, a 1|2 split, a bridge), for 3-12 s: long enough for elections.
    """

    name = "partition"

    def __init__(self, low=3.0, high=12.0):
        self.low, self.high = low, high

    def unavailable(self, target):
        return target.partition_unavailable()

    @defer.inlineCallbacks
    def inject(self, reactor, rng, target):
        length = rng.uniform(self.low, self.high)
        try:
            what = yield target.draw_partition(rng)
            yield sleep(reactor, length)
        finally:
            target.heal_partition()
        return f"partition {what} for {length:.2f} s"


class Flap(Fault):
    """
    A flapping link: one member's link down and up every 0.2-1.5 s for
    2-8 s, then up.
    """

    name = "flap"

    def unavailable(self, target):
        return target.partition_unavailable()

    @defer.inlineCallbacks
    def inject(self, reactor, rng, target):
        member = rng.choice(target.flappable())
        length = rng.uniform(2.0, 8.0)
        start = time.monotonic()
        flips = 0
        try:
            while time.monotonic() - start < length:
                target.set_link(member, flips % 2 == 1)
                flips += 1
                yield sleep(reactor, rng.uniform(0.2, 1.5))
        finally:
            target.set_link(member, True)
        return f"link of {member} flapped {flips} times in {length:.2f} s"


FAULTS = {f.name: f for f in (Kill9(), PowerLoss(), Pause(), ClockJump(), NodeClockJump(),
                                Partition(), Flap())}


class Nemesis:
    """
    Inject faults of C{faults} into C{target} until C{duration} is over:
    a quiet gap drawn from C{gap}, one fault, and again.  C{log} keeps
    C{(seconds since start, description)} of each, for the run's report.
    """

    #: the shortest run given a nemesis: its first fault comes in it
    #: (after a gap of at most 2 s)
    MIN_DURATION = 2.5

    def __init__(self, reactor, rng, faults, target, duration, gap=(0.5, 2.0)):
        self.reactor = reactor
        self.rng = rng
        self.faults = list(faults)
        self.target = target
        self.duration = duration
        self.gap = gap
        self.log = []

    @defer.inlineCallbacks
    def run(self):
        start = time.monotonic()
        while True:
            yield sleep(self.reactor, self.rng.uniform(*self.gap))
            if time.monotonic() - start >= self.duration:
                break
            fault = self.rng.choice(self.faults)
            at = time.monotonic() - start
            what = yield fault.inject(self.reactor, self.rng, self.target)
            self.log.append((at, what))
        return self.log
