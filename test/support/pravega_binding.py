"""
The official Pravega client's Python binding, as the tests drive it:
L{settle}, which waits out the binding's hand-back of a completed future,
for the client programs the interop tests run (L{SETTLE}, as source for
C{python -c}) and the fault matrix's workloads (L{test.faults.refworkloads}).
"""

import asyncio
import inspect
import sys
import threading
import time


async def settle():
    """
    Wait until no client thread is still inside the event loop's
    call_soon_threadsafe.  The binding completes an awaited future from a
    tokio worker that wakes the event loop there and needs the GIL once
    more after the wake-up write, while the binding's blocking calls
    (flush, write_event, reader_offline...) hold the GIL in block_on: one
    made meanwhile can leave that worker, and the connections it serves,
    stuck until a 30 s request timeout (see the module docstring).
    """
    me = threading.get_ident()
    deadline = time.monotonic() + 5

    def waking_the_loop():
        for tid, frame in sys._current_frames().items():
            while tid != me and frame is not None:
                if frame.f_code.co_name in ("call_soon_threadsafe", "_write_to_self"):
                    return True
                frame = frame.f_back
        return False
    await asyncio.sleep(0)
    while waking_the_loop() and time.monotonic() < deadline:
        await asyncio.sleep(0.001)


#: L{settle} with its imports, as source for a client program run with C{python -c}
SETTLE = "import asyncio, sys, threading, time\n\n\n" + inspect.getsource(settle)
