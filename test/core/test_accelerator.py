"""
The C accelerator's visibility (L{streamproto.core.accelerator}): every
surface an operator looks at says when it is missing, and what that costs
(the start-up log, C{/ready}, the metric, C{streamproto status}, the status
page's data); under CI the installed package must have it.

Each test forces the fallback by setting the one place that knows
(C{accelerator.speedups}) to None, and checks the loaded case beside it.
"""

import glob
import importlib
import json
import os
import sys
import time
from importlib import metadata

from prometheus_client import REGISTRY
from twisted.application import service
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactor
from twisted.logger import Logger
from twisted.trial import unittest
from twisted.web.test.requesthelper import DummyRequest

import streamproto
from streamproto import status
from streamproto.core import accelerator, fdlimit
from streamproto.core import metrics  # noqa: F401 - registers streamproto_accelerator
from streamproto.core.ops import HealthResource
from streamproto.core.statuspage import StatusHistory
from streamproto.core.summary import summarise_families
from streamproto.base.clock import SteadySeconds
from streamproto.core.gcpolicy import FULL_EVERY
from streamproto.core.gil import SWITCH_INTERVAL
from streamproto.core.tap import ServerService
from test.core.test_core_gcpolicy import RecordingGC
from test.core.test_core_gil import FakeSys
from test.support.ciutil import under_ci

_BUILT = glob.glob(os.path.join(os.path.dirname(streamproto.__file__), "_speedups*.so"))


class _AcceleratorCase(unittest.SynchronousTestCase):
    def without(self):
        """Run the rest of the test as if the accelerator were not built."""
        self.patch(accelerator, "speedups", None)
        self.patch(accelerator, "IMPORT_ERROR", "No module named 'streamproto._speedups'")

    def with_it(self):
        """Run the rest of the test as if it were loaded (whether built here or not)."""
        self.patch(accelerator, "speedups", accelerator.speedups or streamproto)


class StateTests(_AcceleratorCase):
    def test_missing(self):
        self.without()
        self.assertFalse(accelerator.accelerated())
        warning = accelerator.warning()
        self.assertIn("pure Python", warning)
        self.assertIn(accelerator.COST, warning)
        self.assertIn("pip wheel", warning)
        self.assertEqual(accelerator.details(), {
            "loaded": False, "path": None, "cost": accelerator.COST,
            "reason": "No module named 'streamproto._speedups'"})

    def test_loaded(self):
        self.with_it()
        self.assertTrue(accelerator.accelerated())
        self.assertIsNone(accelerator.warning())
        self.assertTrue(accelerator.details()["loaded"])
        self.assertIsNone(accelerator.details()["cost"])


class PureEnvTests(unittest.SynchronousTestCase):
    def test_pure_python_on_purpose(self):
        """C{STREAMPROTO_PURE_PYTHON=1}: not loaded, and every surface says why."""
        from streamproto.base import speedups

        def reload():
            # the one import attempt (base.speedups), then what reports it
            importlib.reload(speedups)
            importlib.reload(accelerator)
        self.addCleanup(reload)
        self.patch(os, "environ", dict(os.environ, STREAMPROTO_PURE_PYTHON="1"))
        reload()
        self.assertFalse(accelerator.accelerated())
        self.assertIsNone(speedups.speedups)
        self.assertIn("disabled by STREAMPROTO_PURE_PYTHON", accelerator.warning())
        self.patch(os, "environ", dict(os.environ, STREAMPROTO_PURE_PYTHON="0"))
        reload()
        self.assertEqual(accelerator.accelerated(), bool(_BUILT))


class InstalledTests(unittest.SynchronousTestCase):
    """The package as installed (tox installs a wheel; CI runs tox)."""

    def test_built_means_loaded(self):
        """A built accelerator next to the package is the one loaded (it imports)."""
        expected = bool(_BUILT) and os.environ.get(accelerator.PURE_ENV, "0") == "0"
        self.assertEqual(accelerator.accelerated(), expected, (accelerator.IMPORT_ERROR, _BUILT))

    def test_under_ci_the_installed_package_has_it(self):
        """
        Under CI (C{CI=true}, tox) the accelerator is loaded, and the
        installed distribution (the wheel tox built) ships it: a build that
        silently fell back to pure Python fails here.
        """
        if not under_ci():
            # a developer's checkout may lack a compiler: the test above still holds
            self.assertEqual(accelerator.accelerated(), bool(_BUILT))
            return
        self.assertTrue(accelerator.accelerated(), accelerator.IMPORT_ERROR)
        from streamproto import _speedups  # noqa: F401 - importable, not only found
        # every distribution of the name: trial runs from the checkout, whose
        # streamproto.egg-info (left by build_ext --inplace) lists sources
        # only and comes first on sys.path; the wheel's RECORD is the one
        files = [str(f) for d in metadata.distributions(name="streamproto")
                 for f in (d.files or [])]
        shipped = [f for f in files if f.startswith("streamproto/_speedups") and
                   f.endswith(".so")]
        self.assertTrue(shipped, "the installed streamproto has no _speedups extension")
        # the file store's native fsync threads (Linux: eventfd), built from
        # a second source file (_syncer.c); test.log.test_syncer fails without it under CI
        if sys.platform.startswith("linux"):
            self.assertTrue(hasattr(_speedups, "Syncer"), "the accelerator has no Syncer")


class ReadyTests(_AcceleratorCase):
    def ready(self):
        request = DummyRequest([b"ready"])
        request.path = b"/ready"
        body = HealthResource(lambda: []).render_GET(request)
        return request.responseCode, json.loads(body)

    def test_missing(self):
        """Still ready (nothing refused), but a warning and the details say so."""
        self.without()
        code, body = self.ready()
        self.assertEqual(code, 200)
        self.assertTrue(body["ready"])
        self.assertEqual(body["warnings"], [accelerator.warning()])
        self.assertFalse(body["details"]["accelerator"]["loaded"])
        self.assertEqual(body["details"]["accelerator"]["cost"], accelerator.COST)

    def test_loaded(self):
        self.with_it()
        code, body = self.ready()
        self.assertEqual(body["warnings"], [])
        self.assertTrue(body["details"]["accelerator"]["loaded"])


class MetricTests(_AcceleratorCase):
    """The metric, and what reads it: C{streamproto status} and the status page's data."""

    def summary(self):
        return summarise_families(REGISTRY.collect())

    def test_metric(self):
        self.without()
        self.assertEqual(REGISTRY.get_sample_value("streamproto_accelerator"), 0.0)
        self.assertIs(self.summary()["accelerated"], False)
        self.with_it()
        self.assertEqual(REGISTRY.get_sample_value("streamproto_accelerator"), 1.0)
        self.assertIs(self.summary()["accelerated"], True)

    def test_status_text(self):
        self.without()
        text = status.render(self.summary())
        self.assertEqual(text.splitlines()[0], status.accelerator_warning())
        self.assertIn(accelerator.COST, text)
        self.with_it()
        self.assertNotIn("accelerator", status.render(self.summary()))

    def test_status_json(self):
        self.without()
        self.assertIs(json.loads(status.as_json(self.summary()))["accelerated"], False)

    def test_status_page_data(self):
        self.without()
        snapshot = StatusHistory(Clock()).snapshot()
        self.assertIs(snapshot["accelerated"], False)
        self.assertEqual(snapshot["accelerator_cost"], accelerator.COST)
        self.with_it()
        self.assertIs(StatusHistory(Clock()).snapshot()["accelerated"], True)

    def test_older_server(self):
        """Metrics without the gauge (an older server): no warning, not a guess."""
        summary = self.summary()
        summary["accelerated"] = None
        self.assertNotIn("WARNING", status.render(summary))


class _WallReactor(MemoryReactor):
    """A reactor whose timers are on the wall clock, as a real one's are."""

    seconds = staticmethod(time.time)


class StartupTests(_AcceleratorCase):
    """The start-up log of a twistd server (a L{ServerService} under an application)."""

    def start(self):
        events = []
        application = service.Application("test")
        # not this test process's own collector (gcpolicy's tests cover it)
        self.gc = RecordingGC()
        self.sys = FakeSys(0.005)
        # not this test process's own reactor either
        self.reactor = _WallReactor()
        top = ServerService(gc=self.gc, sys_module=self.sys, clock=self.reactor)
        top.setName("styx-server")
        top.log = Logger(observer=events.append)
        top.setServiceParent(application)   # as twistd does
        top.startService()
        self.addCleanup(top.stopService)
        return top, events

    def test_warns_when_missing(self):
        self.without()
        top, events = self.start()
        warnings = [e for e in events if e["log_level"].name == "warn"]
        self.assertEqual(len(warnings), 1, events)
        self.assertEqual(warnings[0]["warning"], accelerator.warning())

    def test_quiet_when_loaded(self):
        self.with_it()
        top, events = self.start()
        self.assertEqual([e for e in events if e["log_level"].name == "warn"], [])
        # the open files limit was raised (or already high), and said
        before, after = top.open_files_limit
        self.assertGreaterEqual(after, before)
        self.assertTrue(any("open files limit" in e["log_format"] for e in events))

    def test_garbage_collector_tuned(self):
        """The process's server tunes the garbage collector
        (streamproto.core.gcpolicy): full collections rarer (the freeze
        waits for the reactor to run: test_core_gcpolicy)."""
        self.with_it()
        self.start()
        self.assertEqual(self.gc.calls[0], ("set_threshold", (700, 10, FULL_EVERY)))

    def test_switch_interval_shortened(self):
        """The process's server shortens the GIL's switch interval
        (streamproto.core.gil): fsync results reach the reactor sooner."""
        self.with_it()
        self.start()
        self.assertEqual(self.sys.interval, SWITCH_INTERVAL)

    def test_steady_timers(self):
        """The process's server puts its reactor's timers on the monotonic
        clock (streamproto.core.clock.steady_timers)."""
        self.with_it()
        self.start()
        self.assertIsInstance(self.reactor.seconds, SteadySeconds)

    def test_embedded_says_nothing(self):
        """Inside a program's own services: the program decides what to log."""
        self.without()
        events = []
        top = ServerService()
        top.log = Logger(observer=events.append)
        top.startService()
        self.addCleanup(top.stopService)
        self.assertEqual(events, [])
        self.assertIsNone(top.open_files_limit)


class _FakeRlimit:
    RLIMIT_NOFILE = 7
    RLIM_INFINITY = -1

    def __init__(self, soft, hard, refuse=False):
        self.limits = (soft, hard)
        self.refuse = refuse

    def getrlimit(self, which):
        assert which == self.RLIMIT_NOFILE
        return self.limits

    def setrlimit(self, which, limits):
        if self.refuse:
            raise ValueError("not allowed")
        self.limits = limits


class OpenFilesLimitTests(unittest.SynchronousTestCase):
    def test_raised_to_hard(self):
        fake = _FakeRlimit(1024, 524288)
        self.assertEqual(fdlimit.raise_open_files_limit(fake), (1024, 524288))
        self.assertEqual(fake.limits, (524288, 524288))

    def test_infinite_hard(self):
        """An infinite hard limit: up to what the kernel allows (fs.nr_open)."""
        fake = _FakeRlimit(1024, _FakeRlimit.RLIM_INFINITY)
        before, after = fdlimit.raise_open_files_limit(fake)
        self.assertEqual(after, fdlimit._nr_open())
        self.assertEqual(fake.limits, (after, _FakeRlimit.RLIM_INFINITY))

    def test_already_there(self):
        fake = _FakeRlimit(4096, 4096)
        self.assertEqual(fdlimit.raise_open_files_limit(fake), (4096, 4096))

    def test_refused(self):
        fake = _FakeRlimit(1024, 4096, refuse=True)
        self.assertEqual(fdlimit.raise_open_files_limit(fake), (1024, 1024))
        self.assertEqual(fake.limits, (1024, 4096))

