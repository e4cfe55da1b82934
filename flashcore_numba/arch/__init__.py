"""The hardware layer: what the kernels are built from below Numba's surface (cf. CuTe's arch/).

Phases import from here; nothing here imports a phase, the measurement, the course or the CLI.

    sim.py    what Numba's CUDA simulator lacks (warp shuffles, votes, aligned shared arrays),
              supplied so every phase runs there unchanged; and where kernels run (GPU,
              simulator or nowhere)
    smem.py   dynamic shared memory beyond the 48 KB a block gets without asking

    ptx.py    the hand-written PTX of the top-level ptx/ folder turned into device functions,
              by both routes (linked `.func`s, and inline assembly without a call), and the
              operands the PTX takes (shared and global addresses, wgmma descriptors,
              register tuples)
    emulation.py the simulator's registry of the sim_*.py stand-ins, by PTX function name;
                 it imports nothing from the package, so no sim module imports ptx.py
    sim_wmma.py  the simulator's WMMA: Python versions of ptx/wmma.ptx's functions
    sim_mma.py   the simulator's mma.sync, ldmatrix and cp.async, lane by lane with the
                 fragment layouts the PTX ISA documents
    sim_exp2.py  the simulator's 2^x (ptx/exp2.ptx: ex2.approx.ftz, subnormals flushed)
    sim_store.py the simulator's 16-byte global store (ptx/store.ptx), alignment checked
    sim_wgmma.py the simulator's wgmma: a whole tile per call, read through its descriptor
    tma.py       tensor maps for TMA (cuTensorMapEncodeTiled), with the layouts TMA cannot
                 describe refused by name
    sim_tma.py   the simulator's mbarriers and TMA copies (zero fill, 128-byte swizzle)
    sim_warpgroup.py  the simulator's named barriers (and setmaxnreg, a no-op there)
    sim_trace.py the simulator's clock (ptx/trace.ptx's %globaltimer)
    launch.py    Numba's kernel ABI packed once, the driver launch (in the device's primary
                 context, from any thread), `build_cubin`
    scratch.py   the memory kernels need beside their arguments (phase 09's work counter, phase
                 10's split workspace): one owner, per device, stream and shape, bounded
    cache.py     compiled kernels on disk, keyed by everything that changes the code
    compile_speed.py  Numba's inliner copying a device function's IR once per inlined call, not
                 once per block, while the package compiles (the same code, compiled sooner)
    ptx_templates.py  the PTX files written from a template (ptx/templates/wgmma.ptx.in ->
                 ptx/wgmma.ptx) and the check that the committed ones are current
"""
