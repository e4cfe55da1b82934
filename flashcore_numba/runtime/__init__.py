"""The call path: what attention() and its siblings do on torch tensors once a problem has been seen.

    inputs.py      what the entry points take: an argument described (kind, shape, dtype, device, so
                   that every message names it the same way), torch tensors as kernel arrays,
                   torch's current stream
    plan.py        a plan per problem: the kernel loaded, the grid, the parameters packed; a call
                   fills in four pointers and launches (arch/launch.py) on torch's current stream,
                   in the device's primary context whatever thread calls
    kvcache.py     the same for attention_kvcache (phase 10 built paged): no value read back
    varlen.py      the same for attention_varlen (phase 07 or 09 built varlen): a plan per kind
                   of problem, the packed lengths and the grid written per call
    flex.py        the same for flex_attention (phase 14: a user's mods compiled into phase 09's or
                   07's kernel): the block mask's lists and the mods' arrays written per call
    backward.py    the same for the backward (phase 11) that attention()'s autograd runs: its
                   three or four launches settled once per problem
    precompile.py  `flashcore compile`: kernels compiled ahead of time into the kernel cache
                   (arch/cache.py), so that a new process loads instead of compiling
    torch_ops.py   what torch sees of attention(): the custom ops torch.compile traces
                   (flashcore::attention, ::attention_train, ::attention_backward), the autograd
                   Function of an eager call with gradients, and the backward's call

api.attention validates a call, finds its plan (or makes it) and runs it.
"""

from .backward import BackwardPlan
from .kvcache import KVCachePlan
from .plan import Plan, Plans
from .varlen import VarlenPlan

__all__ = ["BackwardPlan", "KVCachePlan", "Plan", "Plans", "VarlenPlan"]
