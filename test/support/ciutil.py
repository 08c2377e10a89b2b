"""What a test does when a program it needs is missing (no tests here)."""

import os

from twisted.trial.unittest import FailTest, SkipTest


def under_ci():
    """Whether this runs under CI (C{CI=true}), where every install step has run."""
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def missing(what):
    """
    C{what} is not installed: skip, saying so, on a developer's machine;
    fail under CI, which installs it (a skip there would hide a broken
    install step).
    """
    if under_ci():
        raise FailTest(f"{what} under CI")
    raise SkipTest(what)
