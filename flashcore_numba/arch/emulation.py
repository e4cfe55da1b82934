"""The simulator's registry of PTX stand-ins: which Python function runs for which PTX function.

Each `sim_*.py` module registers its functions with the `emulation` decorator, under the name
of the `.func` it stands in for. `ptx.function()` imports those modules in the simulator, then
asks `registered(name)` here.

This module imports nothing from the package, so the arrows go one way:
ptx.py -> sim_*.py -> emulation.py. Were the registry in ptx.py, each sim module would import
ptx.py while ptx.py imports them: a circle, which tests/test_layout.py refuses.
"""

from __future__ import annotations

_EMULATIONS: dict = {}


def emulation(name: str):
    """Register the simulator's Python version of PTX function `name` (a decorator)."""

    def register(pyfunc):
        _EMULATIONS[name] = pyfunc
        return pyfunc

    return register


def registered(name: str):
    """The emulation registered for PTX function `name`, or None if there is none."""
    return _EMULATIONS.get(name)
