"""The call path: what attention() does on torch tensors once a problem has been seen.

    plan.py        a plan per problem: the kernel loaded, the grid, the parameters packed; a call
                   fills in four pointers and launches (arch/launch.py) on torch's current stream
    backward.py    the same for the backward (phase 11) that attention()'s autograd runs: its
                   three or four launches settled once per problem
    precompile.py  `flashcore compile`: kernels compiled ahead of time into the kernel cache
                   (arch/cache.py), so that a new process loads instead of compiling

api.attention validates a call, finds its plan (or makes it) and runs it.
"""

from .backward import BackwardPlan
from .plan import Plan

__all__ = ["BackwardPlan", "Plan"]
