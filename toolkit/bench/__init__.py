"""Nightly benchmarks: matrices of model x technique cells, a results store, and a report (see docs/bench.md)."""
