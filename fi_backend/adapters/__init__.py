"""Engine adapters: one module per engine (vllm.py, sglang.py), the only code that imports an engine.

Importing this package (or fi_backend.adapters.vllm) never imports the engine itself: the engine's
plugin hook loads the adapter, and the adapter imports the engine only when the engine asks for it.
"""


def rank_device(device, index=None):
    """The torch.device of this rank's GPU, with its index: an engine may name the device by its type alone
    (SGLang's model_runner.device is "cuda"; its gpu_id is the rank's index). `index` (the engine's) fills in a
    missing one, else the current device, which the engines set to the rank's GPU before building the model.
    Under tensor parallelism every workspace and buffer of a rank then lives on that rank's GPU, never on
    device 0 by default."""
    import torch
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(index) if index is not None else torch.cuda.current_device())
    return device
