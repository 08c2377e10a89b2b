"""
Reliable data streaming (jcoglan/reliably's protocol): JSON lines over TCP or
TLS, a stateless mode (an endless stream of big integers, resumable from the
last value) and a stateful mode (a counted stream of random uint32 values
with message ids, acks, resumption and a final rolling CRC-32).

Layers: L{codec} (sans-IO parsing and encoding), L{sequence} (the value
generators: the npm mersenne-twister chain and the doubling stream),
L{session} (the session store interface and its memory and SQLite
implementations), L{server} and L{client} (thin Twisted protocols).
"""
