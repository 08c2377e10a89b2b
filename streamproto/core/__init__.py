"""Mechanisms every protocol shares: CLI/tap plumbing, TLS, buffers."""
