"""flashcore-numba: FlashAttention written from scratch in Numba CUDA, one phase at a time.

    from flashcore_numba import attention
    out = attention(q, k, v, causal=True)            # the fastest phase
    out = attention(q, k, v, phase="03")             # a given rung of the ladder
    out = attention_kvcache(q, k_cache, v_cache, cache_seqlens, block_table)  # decoding (phase 10)
    out = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)  # packed sequences
    out = flex_attention(q, k, v, score_mod=flex.softcap(50.0), block_mask=flex.create_block_mask(
        flex.sliding_window(1024), None, None, S, S))   # your own score_mod and mask_mod (flex.py, phase 14)

`PHASES` maps phase ids ("01" ...) to their modules; each module's docstring is its lesson.
"""

from .arch import sim as _sim

_sim.install()  # the simulator gains warp shuffles; a no-op on a real GPU

from .api import attention, flex_attention  # noqa: E402
from .inference import attention_kvcache, attention_varlen  # noqa: E402
from .phases import BEST, PHASES, get_phase  # noqa: E402
from .reference import check_close, lowp_attention, reference_attention  # noqa: E402
from .runtime.torch_ops import register_torch_op  # noqa: E402

register_torch_op()  # torch.compile sees attention() as the op flashcore::attention (runtime/torch_ops.py)

__version__ = "0.1.0"
__all__ = ["attention", "flex_attention", "attention_kvcache", "attention_varlen", "PHASES", "BEST", "get_phase", "reference_attention", "lowp_attention",
           "check_close", "__version__"]
