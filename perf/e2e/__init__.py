"""End-to-end serving benchmarks: vLLM and SGLang with fi-backend against their own attention backends.

vllm_bench and sglang_bench run on the GPU machine; serving, metrics, workload and plot import without either
engine (CPU tests, reports).
"""
