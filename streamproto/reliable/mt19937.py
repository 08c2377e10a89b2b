"""
The value chain of the stateful stream: C{new Twister(seed).random_int()} of
npm C{mersenne-twister} 1.1.0, i.e. MT19937 seeded with
C{init_genrand(seed >>> 0)} followed by ONE C{genrand_int32}.

Python's C{random.seed(n)} seeds through C{init_by_array} and gives other
numbers, so the generator is written out here.  Only the first output after
seeding is ever used, and the first tempered output depends on three state
words only: C{mt[0]} and C{mt[1]} (mixed into the new C{mt[0]}) and
C{mt[397]} (xored in).  So instead of the full 624-word seeding plus a
624-word twist (~1250 steps) we run the seeding recurrence up to index 397
and do one twist step: about a third of the work, bit for bit the same.

The recurrence is strictly sequential (each word depends on the previous
one through an xor-shift that does not commute with the multiply), so there
is no shortcut in pure Python; an optional C accelerator
(C{streamproto._speedups.mt19937_first}) is used when it is built.
"""

_MULTIPLIER = 1812433253
_MATRIX_A = 0x9908B0DF
_UPPER_MASK = 0x80000000
_LOWER_MASK = 0x7FFFFFFF
_MASK32 = 0xFFFFFFFF
#: the twist of word 0 xors in word 0 + M (M = 397)
_M = 397


def _build_first_random_int():
    """
    Generate a straight-line function for the 397 seeding steps: the loop
    counter and its range object cost as much as the arithmetic itself, and
    with the step index as a literal each line is a handful of int opcodes.
    """
    lines = [
        "def first_random_int(seed):",
        "    s = seed & 0xFFFFFFFF",
        "    x = (1812433253 * (s ^ (s >> 30)) + 1) & 0xFFFFFFFF",
        "    m1 = x",
    ]
    for i in range(2, _M + 1):
        lines.append(f"    x = (1812433253 * (x ^ (x >> 30)) + {i}) & 0xFFFFFFFF")
    lines += [
        "    y = (s & 0x80000000) | (m1 & 0x7FFFFFFF)",
        "    y = x ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)",
        "    y ^= y >> 11",
        "    y ^= (y << 7) & 0x9D2C5680",
        "    y ^= (y << 15) & 0xEFC60000",
        "    return y ^ (y >> 18)",
    ]
    namespace = {}
    exec(compile("\n".join(lines), "<mt19937 first_random_int>", "exec"), namespace)  # noqa: S102
    function = namespace["first_random_int"]
    function.__doc__ = (
        "C{new Twister(seed).random_int()} of npm mersenne-twister 1.1.0: the "
        "first genrand_int32 after init_genrand(seed >>> 0).")
    function.__module__ = __name__
    return function


first_random_int_python = _build_first_random_int()


def reference_first_random_int(seed):
    """
    The textbook MT19937 (full 624-word seeding, full twist, first output),
    kept as the oracle that the shortcut is tested against.
    """
    mt = [0] * 624
    mt[0] = seed & _MASK32
    for i in range(1, 624):
        prev = mt[i - 1]
        mt[i] = (_MULTIPLIER * (prev ^ (prev >> 30)) + i) & _MASK32
    for k in range(624):
        y = (mt[k] & _UPPER_MASK) | (mt[(k + 1) % 624] & _LOWER_MASK)
        mt[k] = mt[(k + _M) % 624] ^ (y >> 1) ^ (_MATRIX_A if y & 1 else 0)
    y = mt[0]
    y ^= y >> 11
    y ^= (y << 7) & 0x9D2C5680
    y ^= (y << 15) & 0xEFC60000
    return y ^ (y >> 18)


try:
    from streamproto._speedups import mt19937_first as first_random_int_c
except ImportError:  # the accelerator is optional
    first_random_int_c = None

#: the fastest implementation available
first_random_int = first_random_int_c or first_random_int_python
