"""End-to-end serving benchmarks: vLLM with fi-backend (CUSTOM) against vLLM's own attention backends.

vllm_bench runs on the GPU machine; metrics, workload and plot import without vLLM (CPU tests, reports).
"""
