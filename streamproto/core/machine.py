"""
Helpers for the suite's automat state machines (C{MethodicalMachine}).
"""

from __future__ import annotations

from typing import Any


def ignore(state: Any, *inputs: Any) -> None:
    """
    In C{state}, each of C{inputs} changes nothing (no output, same state).

    Why: a machine that has ended, or is ending, still hears of a timer
    that fired, a store answering late or the transport going: that is
    part of its design, not an error, and a state says so in one line
    rather than in one empty transition an input.  Call it in the class
    body, with the state and the inputs the machine declared.
    """
    for input_ in inputs:
        state.upon(input_, enter=state, outputs=[])
