"""
Relink: multiplexed, resumable links with channels, transactions and
multicast over any byte stream (spec: Relink protocol version 0 draft).
"""
