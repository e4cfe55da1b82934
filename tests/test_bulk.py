"""Bulk copies of contiguous bytes (ptx/bulk.ptx): the pieces phase 13's backward moves LSE, delta
and dQ with.

A block loads a run of float32 into shared memory with one flashcore_bulk_load_1d and waits on its
mbarrier; blocks add their shared tiles into one global array with flashcore_bulk_reduce_add_f32,
twice, reusing the tile after the wait. In the simulator the emulation (sim_bulk) runs them; on an
H100 both routes run, with the same expectations. On any machine the kernels are compiled for
sm_90a on both routes and assembled by nvJitLink (in a child process without the simulator).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
from numba import cuda, float32, uint32, uint64

from flashcore_numba.arch import operands, ptx
from flashcore_numba.arch.sim import simulator_enabled

TILE = 64  # floats of a shared tile (256 bytes)
BULK_FUNCTIONS = ("flashcore_bulk_load_1d", "flashcore_bulk_reduce_add_f32", "flashcore_bulk_commit_group",
                  "flashcore_bulk_wait_group_read_0", "flashcore_fence_proxy_async_shared")


def _routes():
    """Both routes on an H100; the simulator has one emulation for both."""
    if simulator_enabled():
        return ("inline",)
    if cuda.get_current_device().compute_capability != (9, 0):
        pytest.skip("bulk copies need an sm_90 GPU")
    return ("link", "inline")


def load_kernel(route: str):
    """A block poisons its shared tile, then one thread loads `nbytes` of `src` (from float `first`)
    into it, from float `at` on; every thread waits on the mbarrier and copies the tile out."""
    bulk_load = ptx.function("bulk.ptx", "flashcore_bulk_load_1d", route)
    fence = ptx.function("bulk.ptx", "flashcore_fence_proxy_async_shared", route)
    # the mbarrier (tma.ptx) inline on either route: what is tested here is bulk.ptx
    init = ptx.function("tma.ptx", "flashcore_mbarrier_init", "inline")
    fence_init = ptx.function("tma.ptx", "flashcore_fence_mbarrier_init", "inline")
    expect_tx = ptx.function("tma.ptx", "flashcore_mbarrier_arrive_expect_tx", "inline")
    wait = ptx.function("tma.ptx", "flashcore_mbarrier_wait", "inline")
    shared_address, global_address = operands.shared_address, operands.global_address

    @cuda.jit
    def load_run(src, first, at, nbytes, out):
        tile = cuda.shared.array(TILE, float32, alignment=128)
        bars = cuda.shared.array(1, uint64, alignment=8)
        tid = cuda.threadIdx.x
        for i in range(tid, TILE, cuda.blockDim.x):
            tile[i] = float32(-1.0)
        fence()  # the poison is written before the async proxy writes the run
        if tid == 0:
            init(shared_address(bars), uint32(1))
            fence_init()
        cuda.syncthreads()
        if tid == 0:
            expect_tx(shared_address(bars), nbytes)
            bulk_load(shared_address(tile) + at * uint32(4), global_address(src) + uint64(first * 4), nbytes,
                      shared_address(bars))
        wait(shared_address(bars), uint32(0))
        for i in range(tid, TILE, cuda.blockDim.x):
            out[i] = tile[i]

    return load_run


def run_load(route, first, at, nbytes, threads=64):
    src = np.random.default_rng().standard_normal(200).astype(np.float32)
    out = cuda.to_device(np.full(TILE, np.nan, np.float32))
    args = (np.uint32(first), np.uint32(at), np.uint32(nbytes))
    load_kernel(route)[1, threads](cuda.to_device(src), *args, out)
    expected = np.full(TILE, -1.0, np.float32)
    n = nbytes // 4
    expected[at:at + n] = src[first:first + n]
    return out.copy_to_host(), expected


def reduce_kernel(route: str):
    """Block b fills its shared tile with values[b, r] and adds it into `out` from float `at` on, for
    rounds r = 0 and 1: the second round rewrites the tile once the first one's reads are done."""
    bulk_add = ptx.function("bulk.ptx", "flashcore_bulk_reduce_add_f32", route)
    commit = ptx.function("bulk.ptx", "flashcore_bulk_commit_group", route)
    wait_read = ptx.function("bulk.ptx", "flashcore_bulk_wait_group_read_0", route)
    fence = ptx.function("bulk.ptx", "flashcore_fence_proxy_async_shared", route)
    shared_address, global_address = operands.shared_address, operands.global_address

    @cuda.jit
    def add_tiles(values, at, out):
        tile = cuda.shared.array(TILE, float32, alignment=128)
        tid = cuda.threadIdx.x
        b = cuda.blockIdx.x
        for r in range(2):
            for i in range(tid, TILE, cuda.blockDim.x):
                tile[i] = values[b, r, i]
            fence()  # this thread's stores become visible to the bulk reduction's reads
            cuda.syncthreads()
            if tid == 0:
                bulk_add(global_address(out) + uint64(at * 4), shared_address(tile), uint32(TILE * 4))
                commit()
                wait_read()  # the tile has been read: it may be written again
            cuda.syncthreads()

    return add_tiles


def run_reduce(route, blocks=6, at=4, threads=32):
    # small integers: every partial sum is exact in float32, in whatever order the additions land
    values = np.random.default_rng().integers(-1000, 1000, size=(blocks, 2, TILE)).astype(np.float32)
    start = np.full(TILE + 8, 0.5, np.float32)
    out = cuda.to_device(start)
    reduce_kernel(route)[blocks, threads](cuda.to_device(values), np.uint32(at), out)
    expected = start.copy()
    expected[at:at + TILE] += values.sum(axis=(0, 1), dtype=np.float64).astype(np.float32)
    return out.copy_to_host(), expected


def test_bulk_load_copies_the_run_and_completes_the_mbarrier():
    """The run lands where it is sent (a 16-byte multiple from either start), every waiting thread
    sees it, and nothing else of the tile changes."""
    for route in _routes():
        for first, at, nbytes in [(0, 0, TILE * 4), (12, 8, 160), (4, 60, 16)]:
            got, expected = run_load(route, first, at, nbytes)
            assert np.array_equal(got, expected), (route, first, at, nbytes, got, expected)


def test_bulk_reduce_adds_every_blocks_tile():
    """Six blocks, two rounds each, into one global run: the sum NumPy computes, exactly; the floats
    on either side of the run keep their value."""
    for route in _routes():
        got, expected = run_reduce(route)
        assert np.array_equal(got, expected), (route, got - expected)


@pytest.mark.skipif(not simulator_enabled(), reason="on the GPU a misaligned bulk copy faults and spoils the "
                                                   "context")
def test_bulk_copies_refuse_what_the_hardware_faults_on_in_the_simulator():
    """A size that is not a multiple of 16, an address that is not 16-byte aligned: the GPU faults, the
    emulation raises, naming the operand."""
    aligned = "needs a 16-byte aligned address, got byte offset"
    with pytest.raises(Exception, match=r"bytes: cp.async.bulk moves a multiple of 16 bytes, got 40"):
        run_load("inline", 0, 0, 40, threads=1)
    with pytest.raises(Exception, match=rf"src: cp.async.bulk {aligned} 4"):
        run_load("inline", 1, 0, 16, threads=1)
    with pytest.raises(Exception, match=rf"dst: cp.reduce.async.bulk {aligned} 8"):
        run_reduce("inline", blocks=1, at=2, threads=1)


# ---------------------------------------------------------------------------------------------
# Both routes compiled for the H100 and assembled by nvJitLink (no GPU needed)
# ---------------------------------------------------------------------------------------------
def compile_both_routes() -> dict:
    """{route: {kernel: {"ptx": text, "log": nvJitLink's log}}}, compiled with the real compiler
    (run this file as a script, without the simulator)."""
    from numba import types

    from flashcore_numba.measure.machine_code import assemble

    folder = ptx.ptx_dir()
    signatures = {"load_run": (load_kernel, (types.float32[::1], types.uint32, types.uint32, types.uint32,
                                             types.float32[::1])),
                  "add_tiles": (reduce_kernel, (types.float32[:, :, ::1], types.uint32, types.float32[::1]))}
    found = {}
    for route in ptx.ROUTES:
        for name, (factory, sig) in signatures.items():
            text, _ = cuda.compile_ptx(factory(route).py_func, sig, cc=(9, 0, "a"))
            linked = [folder / "bulk.ptx"] if route == "link" else []
            log, cubin = assemble(text, "sm_90a", linked=linked)
            assert cubin[:4] == b"\x7fELF", (route, name)
            found.setdefault(route, {})[name] = {"ptx": text, "log": log}
    return found


def test_both_routes_assemble_for_hopper():
    """The inline route pastes each instruction into the kernel, as written in ptx/bulk.ptx; the link
    route calls the file's functions; nvJitLink assembles both for sm_90a."""
    from flashcore_numba.measure.machine_code import compiler_env

    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300,
                          env=compiler_env(), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    # nvJitLink prints a call whose prototype differs from the definition's and still links it
    assert "Prototype doesn't match" not in done.stderr, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    bodies = {name: [line.split("//")[0].strip() for line in fn.body.splitlines()
                     if line.strip().startswith(("cp.", "fence."))]
              for name, fn in ptx.load("bulk.ptx").items()}
    uses = {"load_run": ["flashcore_bulk_load_1d", "flashcore_fence_proxy_async_shared"],
            "add_tiles": ["flashcore_bulk_reduce_add_f32", "flashcore_bulk_commit_group",
                          "flashcore_bulk_wait_group_read_0", "flashcore_fence_proxy_async_shared"]}
    assert set().union(*uses.values()) == set(BULK_FUNCTIONS) == set(bodies)
    for kernel, names in uses.items():
        inline = {line.strip() for line in found["inline"][kernel]["ptx"].splitlines()}
        link = found["link"][kernel]["ptx"]
        for name in names:
            assert bodies[name] and set(bodies[name]) <= inline, f"{kernel}, inline route: no {name} inside"
            call = rf"call(\.uni)?\s+(\(\w+\),\s*)?{name}\b"  # `call.uni (retval0), name, (...)`
            assert re.search(call, link), f"{kernel}, link route: no call of {name}"
            assert not set(bodies[name]) & {line.strip() for line in link.splitlines()}, kernel
        assert ".target sm_90a" in found["inline"][kernel]["ptx"]


if __name__ == "__main__":  # the child process of test_both_routes_assemble_for_hopper
    print(json.dumps({route: {k: {"ptx": v["ptx"]} for k, v in kernels.items()}
                      for route, kernels in compile_both_routes().items()}))
