"""Benchmarks: short copies of the real paths that write JSON and compare against baselines measured in the same run."""
