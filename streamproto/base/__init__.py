"""
The foundation: mechanisms with no import from the rest of the suite, under
the log store (L{streamproto.log}) and the core kit (L{streamproto.core})
alike.

  - L{streamproto.base.clock}: the reactor an object uses when none is
    given to it.
  - L{streamproto.base.observer}: Deferreds waiting for something
    (C{Observers}, C{OneShotObserver}, C{SharedCall}).
  - L{streamproto.base.speedups}: the one import attempt of the optional C
    accelerator.

The protocols take them from L{streamproto.core.clock} and
L{streamproto.core.observer}, which name the same objects: the core kit is
what a protocol imports.  doc/architecture.rst draws the layers.
"""
