"""Measurement: what the kernels cost and how fast they run. Uses the library, never used by it.

    bench.py         the benchmark protocol (`flashcore bench`): gate, timing
    records.py       its JSON records: schema, files under docs/bench/, provenance; repo_root
    report.py        `flashcore report`: README headline, docs/performance.md, plots and phase docstrings
    machine_code.py  registers, spills, shared memory, PTX and SASS of a phase, without a GPU
    banks.py         shared-memory bank conflicts of the warp-tiled layouts, from the layout alone
    doctor.py        `flashcore doctor`: is this machine ready?
"""
