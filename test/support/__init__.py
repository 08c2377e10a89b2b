"""The fakes, clusters and helpers the tests of every package share."""
