"""ptx/ and the two routes into a kernel (flashcore_numba.arch.ptx).

On any machine: every file of ptx/ assembles for sm_80 and sm_90a with nvJitLink; the parser
reads the ABI the files declare; the inline route's text is the file's body with only the
parameter moves rewritten; phase 06 compiles on both routes with no spill and no local memory;
the simulator's WMMA emulation computes the products the PTX computes. On a GPU (`gpu`
marker): the link and inline routes give bit-identical results for every function.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from numba import cuda, float32, uint32
from numba.types import float16

from flashcore_numba.arch import ptx

PTX_FILES = sorted(ptx.ptx_dir().glob("*.ptx"))
WMMA_FUNCTIONS = ("flashcore_wmma_abt", "flashcore_wmma_ab")


def test_ptx_folder_is_the_one_at_the_top():
    assert ptx.ptx_dir().name == "ptx" and "wmma.ptx" in [p.name for p in PTX_FILES]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("path", PTX_FILES, ids=lambda p: p.name)
def test_every_ptx_file_assembles(path, arch):
    from flashcore_numba.measure.machine_code import assemble

    log, cubin = assemble(path.read_text(), arch)
    assert cubin[:4] == b"\x7fELF", f"{path.name} for {arch}: no cubin"
    for name in ptx.parse(path):
        assert f"Function properties for {name}" in log, f"{path.name}: {name} was not assembled for {arch}"


@pytest.mark.parametrize("path", PTX_FILES, ids=lambda p: p.name)
def test_every_ptx_file_documents_its_abi(path):
    """Each file says its ABI and its fragment layout, and each function has a comment above it."""
    text = path.read_text()
    assert "ABI" in text and "Fragments" in text, f"{path.name}: say the ABI and the fragment layout"
    for name in ptx.parse(path):
        before = text[:text.index(f" {name}(")].rstrip().splitlines()
        assert before[-2].startswith("//") or before[-1].startswith("//"), f"{path.name}: {name} is undocumented"


def test_parse_wmma():
    from numba import types

    functions = ptx.load("wmma.ptx")
    assert set(functions) == set(WMMA_FUNCTIONS)
    for fn in functions.values():
        assert [name for name, _ in fn.params] == ["c_addr", "a_addr", "b_addr", "c_ld", "a_ld", "b_ld", "k_tiles"]
        assert fn.results == ()  # the return slot is declared (numba's C ABI) but never written
        assert fn.signature == types.void(*[types.uint32] * 7)


def test_inline_text_is_the_body():
    """Only the parameter loads and `ret;` change; every other line of the body is pasted as written."""
    fn = ptx.load("wmma.ptx")["flashcore_wmma_abt"]
    asm, constraints = fn.inline_asm()
    assert asm.startswith("{\n") and asm.endswith("\n}"), "the body gets its own scope (registers, labels)"
    assert "ld.param" not in asm and "st.param" not in asm and "ret;" not in asm
    for i, (name, _) in enumerate(fn.params):
        assert re.search(rf"mov\.b32\s+%\w+, \${i};", asm), f"parameter {name} becomes operand ${i}"
    assert constraints == ",".join(["r"] * 7 + ["~{memory}"])
    kept = [line for line in fn.body.splitlines() if not re.search(r"ld\.param|st\.param|\bret;", line)]
    assert kept == [line for line in asm.splitlines()[1:-1] if not line.startswith("    mov.b32 %") or "$" not in line]


def test_parse_results_and_inline_outputs(tmp_path):
    """A function returning values: outputs come first in the operand numbering, by offset."""
    path = tmp_path / "pair.ptx"
    path.write_text(
        ".version 8.0\n.target sm_80\n.address_size 64\n\n"
        "// x + y and x * y\n"
        ".visible .func (.param .align 4 .b8 func_retval0[8]) pair(\n"
        "    .param .f32 x,\n    .param .f32 y)\n{\n"
        "    .reg .f32 %x, %y, %s, %p;\n"
        "    ld.param.f32 %x, [x];\n    ld.param.f32 %y, [y];\n"
        "    add.f32 %s, %x, %y;\n    mul.f32 %p, %x, %y;\n"
        "    st.param.f32 [func_retval0+4], %p;\n    st.param.f32 [func_retval0], %s;\n"
        "    ret;\n}\n")
    from numba import types

    fn = ptx.parse(path)["pair"]
    assert fn.results == ((0, "f32"), (4, "f32"))
    assert fn.signature == types.UniTuple(types.float32, 2)(types.float32, types.float32)
    asm, constraints = fn.inline_asm()
    assert "mov.f32 %x, $2;" in asm and "mov.f32 %y, $3;" in asm
    assert "mov.f32 $0, %s;" in asm and "mov.f32 $1, %p;" in asm
    assert constraints == "=f,=f,f,f,~{memory}"


def test_unknown_function_and_route_are_named():
    with pytest.raises(ValueError, match="route"):
        ptx.function("wmma.ptx", "flashcore_wmma_abt", "jit")
    with pytest.raises(ValueError, match="flashcore_wmma_nope"):
        ptx.function("wmma.ptx", "flashcore_wmma_nope")


# ---------------------------------------------------------------------------------------------
# Phase 06 compiled for the H100 (no GPU needed)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[64, 128], ids=["D=64", "D=128"])
def phase06_reports(request):
    from flashcore_numba.measure.machine_code import kernel_reports

    return kernel_reports(["06", "06-inline"], request.param)


def test_phase06_has_no_spill_and_no_local_memory(phase06_reports):
    for kid, r in phase06_reports.items():
        assert (r["spill_store_bytes"], r["spill_load_bytes"], r["stack_frame_bytes"]) == (0, 0, 0), (
            f"{kid} D={r['head_dim']}: {r['stack_frame_bytes']} B stack, {r['spill_store_bytes']} B spill stores "
            f"({r['registers']} registers)")
        assert all(frame == 0 for frame in r["callee_frames"].values()), f"{kid}: {r['callee_frames']}"
        assert "st.local" not in r["ptx"] and "ld.local" not in r["ptx"]


def test_phase06_routes(phase06_reports):
    """The link route calls into wmma.ptx; the inline route has the WMMA instructions in the kernel."""
    link, inline = phase06_reports["06"], phase06_reports["06-inline"]
    assert link["linked_ptx"] == ["wmma.ptx"] and inline["linked_ptx"] == []
    assert set(link["callee_frames"]) == set(WMMA_FUNCTIONS)
    call = r"call(\.uni)?\s+(\(\w+\),\s*)?flashcore_wmma_ab"  # `call.uni (retval0), flashcore_wmma_abt, (...)`
    assert re.search(call, link["ptx"]) and "wmma.mma" not in link["ptx"]
    assert not re.search(call, inline["ptx"]) and "wmma.mma" in inline["ptx"]
    # the instructions that run are the ones in ptx/wmma.ptx, as written
    body_ops = {line.split("//")[0].strip() for fn in ptx.load("wmma.ptx").values()
                for line in fn.body.splitlines() if line.strip().startswith("wmma.")}
    inline_lines = {line.split("//")[0].strip() for line in inline["ptx"].splitlines()}
    assert body_ops and body_ops <= inline_lines


# ---------------------------------------------------------------------------------------------
# One call of a WMMA function, in a one-warp kernel: the simulator's emulation, and on a GPU
# both routes
# ---------------------------------------------------------------------------------------------
LD = 136  # row stride of the test tiles (elements): 16-byte multiple, room for K = 128


def route_kernel(name: str, route: str, k_depth: int):
    """A one-warp kernel: A (16 x K) and B into shared memory, one call of `name`, C (16 x 64) out."""
    fn = ptx.function("wmma.ptx", name, route)
    shared_address = ptx.shared_address
    b_rows = 64 if name.endswith("abt") else k_depth
    b_cols = k_depth if name.endswith("abt") else 64

    @cuda.jit
    def one_call(a, b, c):
        A = cuda.shared.array((16, LD), float16, alignment=128)
        B = cuda.shared.array((128, LD), float16, alignment=128)
        C = cuda.shared.array((16, LD), float32, alignment=128)
        t = cuda.threadIdx.x
        for i in range(t, 16 * k_depth, 32):
            A[i // k_depth, i % k_depth] = a[i // k_depth, i % k_depth]
        for i in range(t, b_rows * b_cols, 32):
            B[i // b_cols, i % b_cols] = b[i // b_cols, i % b_cols]
        cuda.syncwarp()
        fn(shared_address(C), shared_address(A), shared_address(B), uint32(LD), uint32(LD), uint32(LD),
           uint32(k_depth // 16))
        cuda.syncwarp()
        for i in range(t, 16 * 64, 32):
            c[i // 64, i % 64] = C[i // 64, i % 64]

    return one_call


def call_once(name, route, k_depth, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((16, k_depth)).astype(np.float16)
    b_shape = (64, k_depth) if name.endswith("abt") else (k_depth, 64)
    b = rng.standard_normal(b_shape).astype(np.float16)
    expected = a.astype(np.float64) @ (b.T if name.endswith("abt") else b).astype(np.float64)
    c = cuda.to_device(np.full((16, 64), np.nan, np.float32))
    route_kernel(name, route, k_depth)[1, 32](cuda.to_device(a), cuda.to_device(b), c)
    return c.copy_to_host(), expected


@pytest.mark.parametrize("k_depth", [16, 64])
@pytest.mark.parametrize("name", WMMA_FUNCTIONS)
def test_emulation_computes_the_product(name, k_depth):
    from flashcore_numba.arch.sim import simulator_enabled

    if not simulator_enabled():
        pytest.skip("checks the simulator's emulation; on a GPU see test_routes_are_bit_identical")
    got, expected = call_once(name, "link", k_depth, seed=None)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4 * np.sqrt(k_depth))


@pytest.mark.gpu
@pytest.mark.parametrize("k_depth", [16, 64, 128])
@pytest.mark.parametrize("name", WMMA_FUNCTIONS)
def test_routes_are_bit_identical(name, k_depth):
    seed = int(np.random.default_rng().integers(1 << 31))
    link, expected = call_once(name, "link", k_depth, seed)
    inline, _ = call_once(name, "inline", k_depth, seed)
    assert not np.isnan(link).any()
    assert np.array_equal(link.view(np.uint32), inline.view(np.uint32)), (
        f"{name} K={k_depth} seed={seed}: the routes differ by up to {np.abs(link - inline).max():.3e}")
    np.testing.assert_allclose(link, expected, rtol=1e-3, atol=1e-3 * np.sqrt(k_depth))
