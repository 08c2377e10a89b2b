"""
The fault harness: real servers and nats-server nodes under a seeded
nemesis (kill -9, power loss through a lazy FUSE filesystem, pauses,
partitions, clock jumps), workloads that record histories, and an
independent checker (see doc/reliability.rst, "Faults beyond kill -9").
"""
