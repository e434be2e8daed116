"""The attention API under its historical module name: BatchAttention (fi_backend/attention.py), the module specs
(fi_backend/specs.py) and the choice of kernel shape and tile family (fi_backend/shapes.py), re-exported so that
`from fi_backend.wrappers import ...` keeps working."""
from .attention import (KV_DTYPES, MAX_PAGE_SIZE, PLAN_GROUPED_MIN_KV, Q_DTYPES, BatchAttention,  # noqa: F401
                        _fastdiv, _launcher)
from .shapes import (FAMILY_TILES_PER_CTA, FAMILY_WAVE_SLACK, HEAD_DIMS, PREFILL_FA3_TUNINGS, PREFILL_MAX_HEADS_PER_CHUNK,  # noqa: F401
                     PREFILL_PRODUCER_Q_BUFFERS, PREFILL_WS_TUNINGS, SMEM_PER_CTA, SMEM_PER_SM, _kernel_shape,
                     _prefill_family, _prefill_q_buffers, _prefill_shape, _prefill_smem_bytes, _smem_bytes,
                     decode_family_size, prefill_family_shapes, prefill_family_size, prefill_uses_wgmma)
from .specs import (_SPECS, DECODE_TUNING_KEYS, KERNELS, PREFILL_TUNING_KEYS, attention_specs,  # noqa: F401
                    decode_spec, prefill_spec)

__all__ = ["BatchAttention", "decode_spec", "prefill_spec", "KERNELS", "HEAD_DIMS", "Q_DTYPES", "KV_DTYPES"]
