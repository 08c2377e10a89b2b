"""
L{streamproto.core.gcpolicy}: the garbage collector's settings for a
server, on a recording stand-in for the C{gc} module (the test process's
own collector is left alone), then once on the real one.
"""

import gc

from twisted.trial import unittest

from streamproto.core.gcpolicy import FULL_EVERY, freeze_start_up, tune_for_server


class RecordingGC:
    """The parts of the C{gc} module gcpolicy uses, recording its calls."""

    def __init__(self):
        self.calls = []
        self.threshold = (700, 10, 10)

    def get_threshold(self):
        return self.threshold

    def set_threshold(self, *threshold):
        self.calls.append(("set_threshold", threshold))
        self.threshold = threshold

    def collect(self):
        self.calls.append(("collect", ()))
        return 0

    def freeze(self):
        self.calls.append(("freeze", ()))

    def get_freeze_count(self):
        return 1234


class NotRunningReactor:
    """A reactor before C{run}: what C{callWhenRunning} was given."""

    def __init__(self):
        self.when_running = []

    def callWhenRunning(self, f, *args):
        self.when_running.append((f, args))


class TuneTests(unittest.SynchronousTestCase):

    def test_thresholds_now_freeze_when_running(self):
        """Full collections are considered every FULL_EVERY generation-1
        collections (young thresholds kept) at once; the freeze waits for
        the reactor to run (everything imported and configured by then)."""
        recording = RecordingGC()
        reactor = NotRunningReactor()
        tune_for_server(reactor, recording)
        self.assertEqual(recording.calls, [("set_threshold", (700, 10, FULL_EVERY))])
        self.assertGreater(FULL_EVERY, 10)
        [(f, args)] = reactor.when_running
        f(*args)
        self.assertEqual(recording.calls[1:], [("collect", ()), ("freeze", ())])

    def test_young_thresholds_kept(self):
        """Thresholds someone set before (generations 0 and 1) are kept."""
        recording = RecordingGC()
        recording.threshold = (5000, 20, 10)
        tune_for_server(NotRunningReactor(), recording)
        self.assertEqual(recording.get_threshold(), (5000, 20, FULL_EVERY))

    def test_freeze_for_real(self):
        """On the real collector: garbage is collected first, then what is
        left is frozen (and stays alive: frozen is not freed)."""
        self.addCleanup(gc.unfreeze)

        class Cycle:
            pass
        garbage = Cycle()
        garbage.me = garbage
        import weakref
        gone = weakref.ref(garbage)
        kept = Cycle()
        del garbage
        frozen = freeze_start_up()
        self.assertIsNone(gone())       # collected before the freeze
        self.assertGreater(frozen, 0)
        self.assertIsNotNone(kept)
