"""Engine adapters: one module per engine (vllm.py, sglang.py), the only code that imports an engine.

Importing this package (or fi_backend.adapters.vllm) never imports the engine itself: the engine's
plugin hook loads the adapter, and the adapter imports the engine only when the engine asks for it.
"""
