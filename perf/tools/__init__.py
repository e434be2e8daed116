"""One-off investigation tools kept because they still answer questions (perf/tools/README.md)."""
