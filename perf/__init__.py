"""Benchmarks: each script prints its figures and, where it says so, writes JSON to perf/results/."""
