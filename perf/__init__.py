"""The benchmark suite: `python -m perf COMMAND` (perf/__main__.py); results and their index in perf/results/."""
