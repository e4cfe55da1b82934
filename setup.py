"""Which packages the wheel holds; everything else about the project is in pyproject.toml.

Every package under flashcore_numba/ is found, not listed by hand (a new one cannot be left out of
the wheel). The hand-written PTX lives at the top of the repository (ptx/); the wheel carries it
inside the package as flashcore_numba/ptx/, where flashcore_numba.arch.ptx also looks for it.
pyproject.toml cannot say both, so this file does.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["flashcore_numba", "flashcore_numba.*"]) + ["flashcore_numba.ptx"],
    package_dir={"flashcore_numba.ptx": "ptx"},
)
