"""
L{streamproto.core.gil}: the switch interval of a server process, on a
stand-in for the C{sys} module (this test process's own is left alone).
"""

from twisted.trial import unittest

from streamproto.core.gil import SWITCH_INTERVAL, shorten_switch_interval


class FakeSys:
    def __init__(self, interval):
        self.interval = interval

    def getswitchinterval(self):
        return self.interval

    def setswitchinterval(self, interval):
        self.interval = interval


class ShortenTests(unittest.SynchronousTestCase):

    def test_default_shortened(self):
        """CPython's 5 ms becomes SWITCH_INTERVAL; the old value is returned."""
        fake = FakeSys(0.005)
        self.assertEqual(shorten_switch_interval(fake), 0.005)
        self.assertEqual(fake.interval, SWITCH_INTERVAL)
        self.assertLess(SWITCH_INTERVAL, 0.005)

    def test_shorter_kept(self):
        """An interval someone already made shorter is left as it is."""
        fake = FakeSys(0.0001)
        shorten_switch_interval(fake)
        self.assertEqual(fake.interval, 0.0001)
