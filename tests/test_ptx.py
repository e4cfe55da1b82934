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
from numba import cuda, float32, uint16, uint32, uint64
from numba.types import float16

from flashcore_numba.arch import operands, ptx

PTX_FILES = sorted(ptx.ptx_dir().glob("*.ptx"))
WMMA_FUNCTIONS = ("flashcore_wmma_abt", "flashcore_wmma_ab")


def test_ptx_folder_is_the_one_at_the_top():
    assert ptx.ptx_dir().name == "ptx" and "wmma.ptx" in [p.name for p in PTX_FILES]


def _target(path) -> str:
    return re.search(r"^\.target\s+(\w+)", path.read_text(), re.M).group(1)


# every file for the H100, and for the A100 the files that do not need Hopper (wgmma.ptx: sm_90a)
ASSEMBLE_CASES = [pytest.param(path, arch, id=f"{path.name}-{arch}") for path in PTX_FILES
                  for arch in ("sm_80", "sm_90a") if arch == "sm_90a" or _target(path) == "sm_80"]


def test_hopper_only_files_say_so():
    assert _target(ptx.ptx_dir() / "wgmma.ptx") == "sm_90a"
    assert {_target(p) for p in PTX_FILES} <= {"sm_80", "sm_90a"}


@pytest.mark.parametrize("path,arch", ASSEMBLE_CASES)
def test_every_ptx_file_assembles(path, arch):
    from flashcore_numba.measure.machine_code import assemble

    log, cubin = assemble(path.read_text(), arch)
    assert cubin[:4] == b"\x7fELF", f"{path.name} for {arch}: no cubin"
    # the linker drops functions nothing calls, but the assembler's log lists each one it compiled
    # (where nvJitLink reports the assembler's details at all: pip's does, some drivers' do not)
    if "Function properties" in log:
        for name in ptx.parse(path):
            assert f"Function properties for {name}" in log, f"{path.name}: {name} not assembled for {arch}"


def test_registers_named_like_the_compilers_are_refused(tmp_path):
    path = tmp_path / "bad.ptx"
    path.write_text(".version 8.0\n.target sm_80\n.address_size 64\n\n"
                    ".visible .func (.param .b32 func_retval0) bad(\n    .param .b32 x)\n{\n"
                    "    .reg .b32   %addr, %r<4>;\n    ld.param.b32 %r0, [x];\n"
                    "    st.param.b32 [func_retval0], %r0;\n    ret;\n}\n")
    with pytest.raises(ValueError, match="bad declares register .*%r<4>"):
        ptx.parse(path)


@pytest.mark.parametrize("path", PTX_FILES, ids=lambda p: p.name)
def test_every_ptx_file_is_ascii(path):
    """ptxas refuses a non-ASCII character anywhere, comments included ("Unexpected non-ASCII
    character"), though some nvJitLink releases let it pass: the link route would fail on those."""
    bad = [n for n, line in enumerate(path.read_text().splitlines(), 1) if not line.isascii()]
    assert not bad, f"{path.name}: non-ASCII characters on lines {bad}"


@pytest.mark.parametrize("path", PTX_FILES, ids=lambda p: p.name)
def test_every_ptx_file_documents_its_abi(path):
    """Each file says its ABI and its fragment layout, and each function has a comment above it."""
    text = path.read_text()
    assert "ABI" in text and "Fragments" in text, f"{path.name}: say the ABI and the fragment layout"
    for name in ptx.parse(path):
        before = text[:text.index(f" {name}(")].rstrip().splitlines()
        assert before[-2].startswith("//") or before[-1].startswith("//"), f"{path.name}: {name} is undocumented"


@pytest.mark.parametrize("path", PTX_FILES, ids=lambda p: p.name)
def test_every_function_is_read_and_declares_numbas_return_slot(path):
    """Every `.visible .func` of the file is one the reader finds (a header it cannot read would leave
    the function out of both routes), and every one declares `func_retval0`: Numba's call passes a
    64-bit slot even for a function returning None, and a definition without it is a call whose
    prototype differs from the definition's on the link route (nvJitLink warns and links it anyway)."""
    import re

    headers = re.findall(r"^\.visible \.func\b[^\n]*", path.read_text(), flags=re.M)
    found = ptx.parse(path)
    assert len(found) == len(headers), f"{path.name}: {len(headers)} functions, {len(found)} read"
    without = [h for h in headers if "func_retval0" not in h]
    assert not without, f"{path.name}: no return slot in {without}"


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
    assert constraints == "=f,=f,f,f", "registers only: no memory clobber"
    assert not fn.touches_memory and ptx.load("wmma.ptx")["flashcore_wmma_ab"].touches_memory


def test_unknown_function_and_route_are_named():
    with pytest.raises(ValueError, match="route"):
        ptx.function("wmma.ptx", "flashcore_wmma_abt", "jit")
    with pytest.raises(ValueError, match="flashcore_wmma_nope"):
        ptx.function("wmma.ptx", "flashcore_wmma_nope")


# ---------------------------------------------------------------------------------------------
# Phases 06 to 09 compiled for the H100 (no GPU needed). Each param of the report fixtures below is
# one `kernel_reports` call: in the simulator a subprocess of 5 to 35 s. In a simulator session
# they start as background jobs (the root conftest.py) as soon as the session's tests are known: a
# thread of the pool only waits for its subprocess, so this process goes on with the other tests,
# and the tests that read the reports run last.
# ---------------------------------------------------------------------------------------------
REPORT_PHASES = {"phase06_reports": ("06", "06-inline"), "phase07_report": ("07",), "phase08_report": ("08",),
                 "phase09_report": ("09",)}  # report fixture -> the kernels it compiles


def _report_args(fixture: str, param) -> tuple:
    """(phase ids, head dim, dtype): the kernel_reports call behind one param of a report fixture."""
    head_dim, dtype = param if isinstance(param, tuple) else (param, "float16")  # phase 06: the head dim
    return REPORT_PHASES[fixture], head_dim, dtype


def _compile(phase_ids, head_dim, dtype) -> dict:
    from flashcore_numba.measure.machine_code import kernel_reports

    return kernel_reports(phase_ids, head_dim, dtype=dtype)


BACKGROUND_FIRST = True  # its sm_90a compiles of phase 09 (minutes each on a CI core) go to the pool early, not last


def start_background(items, pool):
    """The compiles the selected tests read, one job each in the session's pool (conftest.py): a
    compile that several tests read is submitted once."""
    wanted = dict.fromkeys(_report_args(name, item.callspec.params[name]) for item in items
                           for name in REPORT_PHASES if name in getattr(item, "fixturenames", ()))
    return {args: pool.submit(_compile, *args) for args in wanted} or None


def compiled(request, background) -> dict:
    """{phase id: report} for the param of the report fixture asking: the background job's result;
    compiled here in a GPU session (no background jobs), or if the job is still waiting for a worker
    of the pool (cancel() then takes it off the queue: it never runs twice)."""
    args = _report_args(request.fixturename, request.param)
    job = (background or {}).get(args)
    if job is None or job.cancel():
        return _compile(*args)
    return job.result()


@pytest.fixture(scope="module", params=[64, 128], ids=["D=64", "D=128"])
def phase06_reports(request, background):
    return compiled(request, background)


@pytest.mark.slow
def test_phase06_has_no_spill_and_no_local_memory(phase06_reports):
    for kid, r in phase06_reports.items():
        assert (r["spill_store_bytes"], r["spill_load_bytes"], r["stack_frame_bytes"]) == (0, 0, 0), (
            f"{kid} D={r['head_dim']}: {r['stack_frame_bytes']} B stack, {r['spill_store_bytes']} B spill stores "
            f"({r['registers']} registers)")
        assert all(frame == 0 for frame in r["callee_frames"].values()), f"{kid}: {r['callee_frames']}"
        assert "st.local" not in r["ptx"] and "ld.local" not in r["ptx"]


@pytest.mark.slow
def test_phase06_routes(phase06_reports):
    """The link route calls into wmma.ptx; the inline route has the WMMA instructions in the kernel."""
    link, inline = phase06_reports["06"], phase06_reports["06-inline"]
    assert link["linked_ptx"] == ["wmma.ptx"] and inline["linked_ptx"] == []
    # the assembler's log lists each called function's frame (some nvJitLink versions omit them)
    assert set(link["callee_frames"]) <= set(WMMA_FUNCTIONS)
    call = r"call(\.uni)?\s+(\(\w+\),\s*)?flashcore_wmma_ab"  # `call.uni (retval0), flashcore_wmma_abt, (...)`
    assert re.search(call, link["ptx"]) and "wmma.mma" not in link["ptx"]
    assert not re.search(call, inline["ptx"]) and "wmma.mma" in inline["ptx"]
    # the instructions that run are the ones in ptx/wmma.ptx, as written
    body_ops = {line.split("//")[0].strip() for fn in ptx.load("wmma.ptx").values()
                for line in fn.body.splitlines() if line.strip().startswith("wmma.")}
    inline_lines = {line.split("//")[0].strip() for line in inline["ptx"].splitlines()}
    assert body_ops and body_ops <= inline_lines


# ---------------------------------------------------------------------------------------------
# Phase 07 compiled for the H100: fragments stay in registers (no spill, no local memory)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[(64, "float16"), (128, "float16"), (64, "bfloat16"), (128, "bfloat16")],
                ids=["D=64 fp16", "D=128 fp16", "D=64 bf16", "D=128 bf16"])
def phase07_report(request, background):
    return compiled(request, background)["07"]


def assert_scores_take_one_ex2(ptx_text: str, scores: int, where: str):
    """The exponentials of the scores are ptx/exp2.ptx's ex2.approx.ftz.f32 (one MUFU.EX2 each),
    at least `scores` of them (a lane's scores of one tile); Numba's math.exp2 (ex2.approx.f32,
    which ptxas wraps in subnormal fix-ups) is left only for alpha, a few per row and tile."""
    ftz = len(re.findall(r"\bex2\.approx\.ftz\.f32\b", ptx_text))
    plain = len(re.findall(r"\bex2\.approx\.f32\b", ptx_text))
    assert ftz >= scores, f"{where}: {ftz} ex2.approx.ftz.f32, expected one per score ({scores} or more)"
    assert plain * 8 <= ftz, f"{where}: {plain} ex2.approx.f32 (with fix-ups) beside {ftz} ex2.approx.ftz.f32"


@pytest.mark.slow
def test_phase07_has_no_spill_and_no_local_memory(phase07_report):
    r = phase07_report
    where = f"phase 07 D={r['head_dim']} {r['dtype']}"
    assert (r["spill_store_bytes"], r["spill_load_bytes"], r["stack_frame_bytes"]) == (0, 0, 0), (
        f"{where}: {r['stack_frame_bytes']} B stack, {r['spill_store_bytes']} B spill stores, "
        f"{r['spill_load_bytes']} B spill loads ({r['registers']} registers)")
    assert "st.local" not in r["ptx"] and "ld.local" not in r["ptx"], f"{where}: local memory in the PTX"


@pytest.mark.slow
def test_phase07_has_no_spill_with_a_toolkits_ptxas(phase07_report):
    """The same PTX assembled by a CUDA toolkit's ptxas, when one is installed: the GPU machine's
    nvJitLink may be older than this machine's, and an older ptxas may spill where a newer one
    does not (docs/tuning/07_history.md: 32 B on the GPU for a kernel nvJitLink 13.5 compiled
    without spills; ptxas 13.0 here gave the GPU's 32 B)."""
    from flashcore_numba.measure.machine_code import assemble_with_ptxas, find_ptxas, parse_resource_usage

    ptxas = find_ptxas()
    if ptxas is None:
        pytest.skip("no CUDA toolkit ptxas on PATH (or in FLASHCORE_PTXAS)")
    r = phase07_report
    usage = parse_resource_usage(assemble_with_ptxas(r["ptx"], ptxas))
    assert (usage["spill_store_bytes"], usage["spill_load_bytes"], usage["stack_frame_bytes"]) == (0, 0, 0), (
        f"phase 07 D={r['head_dim']} {r['dtype']} with {ptxas}: {usage}")


@pytest.mark.slow
def test_phase07_is_inline_mma_ldmatrix_and_cp_async(phase07_report):
    r = phase07_report
    kind = "bf16" if r["dtype"] == "bfloat16" else "f16"
    ptx_text = r["ptx"]
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32" in ptx_text
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx_text
    assert "cp.async.cg.shared.global" in ptx_text and f"cvt.rn.{kind}x2.f32" in ptx_text
    # the scale folded into the exponent: s * scale - m_i is one fma per score (a lane holds 4 scores
    # of each 8-key n-tile: BLOCK_N / 2 per tile)
    from flashcore_numba.measure.machine_code import instruction_counts
    from flashcore_numba.phases import p07_mma_sync

    scores = p07_mma_sync.TILES[r["head_dim"]]["block_n"] // 2
    assert instruction_counts(ptx_text, ["fma.rn.f32"])["fma.rn.f32"] >= scores
    assert_scores_take_one_ex2(ptx_text, scores=scores, where=f"phase 07 D={r['head_dim']} {r['dtype']}")
    assert not re.search(r"^\s*call", ptx_text, re.M), "every PTX function is inlined: no call"
    assert r["linked_ptx"] == []


# ---------------------------------------------------------------------------------------------
# One call of a WMMA function, in a one-warp kernel: the simulator's emulation, and on a GPU
# both routes
# ---------------------------------------------------------------------------------------------
LD = 136  # row stride of the test tiles (elements): 16-byte multiple, room for K = 128


def route_kernel(name: str, route: str, k_depth: int):
    """A one-warp kernel: A (16 x K) and B into shared memory, one call of `name`, C (16 x 64) out."""
    fn = ptx.function("wmma.ptx", name, route)
    shared_address = operands.shared_address
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


# ---------------------------------------------------------------------------------------------
# mma.sync, ldmatrix, cp.async (ptx/mma_sync.ptx, ldmatrix.ptx, cp_async.ptx): one kernel per
# instruction family, run in the simulator (the emulation) and on a GPU (both routes). Each
# gathers or scatters fragments with the layout the files document, so on a GPU the test also
# checks that the documented layout is the hardware's.
# ---------------------------------------------------------------------------------------------
def mma_kernel(kind: str, route: str):
    mma = ptx.function("mma_sync.ptx", f"flashcore_mma_{kind}", route)

    @cuda.jit
    def one_mma(A32, BT32, C, D):
        # A32: A (16 x 16) as .b32 pairs along rows; BT32: B transposed (8 x 16) as pairs along k
        lane = cuda.threadIdx.x
        g, t = lane // 4, lane % 4
        d0, d1, d2, d3 = mma(A32[g, t], A32[g + 8, t], A32[g, t + 4], A32[g + 8, t + 4],
                             BT32[g, t], BT32[g, t + 4],
                             C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1])
        D[g, 2 * t] = d0
        D[g, 2 * t + 1] = d1
        D[g + 8, 2 * t] = d2
        D[g + 8, 2 * t + 1] = d3

    return one_mma


def run_mma(kind, route, seed):
    from flashcore_numba.arch.sim_mma import bf16_bits

    rng = np.random.default_rng(seed)
    a, b, c = rng.standard_normal((16, 16)), rng.standard_normal((16, 8)), rng.standard_normal((16, 8))
    if kind == "f16":
        a_bits, bt_bits = a.astype(np.float16).view(np.uint16), b.T.copy().astype(np.float16).view(np.uint16)
        a_val = a_bits.view(np.float16).astype(np.float64)
        b_val = bt_bits.view(np.float16).astype(np.float64).T
    else:
        to_bits = np.vectorize(bf16_bits, otypes=[np.uint16])
        a_bits, bt_bits = to_bits(a.astype(np.float32)), to_bits(b.T.copy().astype(np.float32))
        widen = lambda bits: (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)  # noqa: E731
        a_val, b_val = widen(a_bits), widen(bt_bits).T
    c = c.astype(np.float32)
    d = cuda.to_device(np.full((16, 8), np.nan, np.float32))
    mma_kernel(kind, route)[1, 32](cuda.to_device(a_bits.view(np.uint32)), cuda.to_device(bt_bits.view(np.uint32)),
                                   cuda.to_device(c), d)
    return d.copy_to_host(), a_val @ b_val + c


def ldmatrix_kernel(trans: bool, route: str):
    ldm = ptx.function("ldmatrix.ptx", "flashcore_ldmatrix_x4_trans" if trans else "flashcore_ldmatrix_x4", route)
    shared_address = operands.shared_address
    STRIDE = 24  # 16 b16 values + 8 of padding: rows 48 bytes apart, 16-byte aligned

    @cuda.jit
    def four_matrices(M, out):
        tile = cuda.shared.array((16, STRIDE), uint16, alignment=128)
        lane = cuda.threadIdx.x
        for i in range(lane, 256, 32):
            tile[i // 16, i % 16] = M[i // 16, i % 16]
        cuda.syncwarp()
        # matrix i = lane // 8: rows 8 (i % 2) .., columns 8 (i // 2) ..: the order of a0..a3
        i, r = lane // 8, lane % 8
        row_addr = shared_address(tile) + ((i % 2) * 8 + r) * STRIDE * 2 + (i // 2) * 16
        r0, r1, r2, r3 = ldm(row_addr)
        out[lane, 0] = r0
        out[lane, 1] = r1
        out[lane, 2] = r2
        out[lane, 3] = r3

    return four_matrices


def expected_ldmatrix(M, trans):
    """The documented fragments: register i of lane l = row l // 4 (column, with .trans) of matrix i."""
    out = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            sub = M[(i % 2) * 8:(i % 2) * 8 + 8, (i // 2) * 8:(i // 2) * 8 + 8]
            lo, hi = (sub[2 * t, g], sub[2 * t + 1, g]) if trans else (sub[g, 2 * t], sub[g, 2 * t + 1])
            out[lane, i] = (int(hi) << 16) | int(lo)
    return out


def cp_async_kernel(route: str):
    copy = ptx.function("cp_async.ptx", "flashcore_cp_async_16", route)
    commit = ptx.function("cp_async.ptx", "flashcore_cp_async_commit", route)
    wait_all = ptx.function("cp_async.ptx", "flashcore_cp_async_wait_0", route)
    shared_address, global_address = operands.shared_address, operands.global_address

    @cuda.jit
    def copy_rows(src, src_bytes, out):
        # lane l copies 16 bytes of row l, of which src_bytes[l] are read and the rest zero-filled
        buf = cuda.shared.array((32, 16), uint16, alignment=128)
        lane = cuda.threadIdx.x
        copy(shared_address(buf) + lane * 32, global_address(src) + uint64(lane * 32), src_bytes[lane])
        copy(shared_address(buf) + lane * 32 + 16, global_address(src) + uint64(lane * 32 + 16), uint32(16))
        commit()
        wait_all()
        cuda.syncwarp()
        for j in range(16):
            out[lane, j] = buf[lane, j]

    return copy_rows


def pack_kernel(kind: str, route: str):
    pack = ptx.function("mma_sync.ptx", f"flashcore_pack_{kind}x2", route)

    @cuda.jit
    def pack_pairs(lo, hi, out):
        i = cuda.threadIdx.x
        out[i] = pack(lo[i], hi[i])

    return pack_pairs


PACK_VALUES = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 1e-8, 1.0009765625, 1.00048828125, 3.14159265,
                        -1e30, 1.00390625, 1.001953125, 6e-5, 7e-8, 0.333333333, 1e5], np.float32)


def run_pack(kind, route):
    lo, hi = PACK_VALUES, PACK_VALUES[::-1].copy()
    out = cuda.to_device(np.zeros(16, np.uint32))
    pack_kernel(kind, route)[1, 16](cuda.to_device(lo), cuda.to_device(hi), out)
    return out.copy_to_host(), lo, hi


def expected_pack(kind, lo, hi):
    from flashcore_numba.arch.sim_mma import bf16_bits, f16_bits

    bits = f16_bits if kind == "f16" else bf16_bits
    return np.array([(bits(h) << 16) | bits(x) for x, h in zip(lo, hi)], np.uint32)


def unpack_kernel(kind: str, route: str):
    unpack = ptx.function("mma_sync.ptx", f"flashcore_unpack_{kind}x2", route)

    @cuda.jit
    def unpack_pairs(packed, lo, hi):
        i = cuda.threadIdx.x
        lo[i], hi[i] = unpack(packed[i])

    return unpack_pairs


def exp2_kernel(route: str):
    exp2 = ptx.function("exp2.ptx", "flashcore_exp2", route)

    @cuda.jit
    def powers_of_two(x, out):
        i = cuda.threadIdx.x
        out[i] = exp2(x[i])

    return powers_of_two


# 2^x where the softmax takes it (x <= 0), the edges of fp32's normal range, and what must
# flush: a subnormal x counts as 0 (2^0 = 1), a result below 2^-126 is 0, not a subnormal
EXP2_VALUES = np.array([0.0, -0.0, -1.0, -0.5, -13.37, -100.0, -125.9, -126.0, -126.5, -149.0, -200.0,
                        -np.inf, 1e-40, -1e-40, 3.5, 127.9, 128.0, np.inf, np.nan, -1e-3, -60.25, -0.0078125,
                        -5.0, -20.0, -30.0, -40.0, -50.0, -70.0, -80.0, -90.0, -110.0, -120.0], np.float32)


def run_exp2(route):
    out = cuda.to_device(np.full(32, -1.0, np.float32))
    exp2_kernel(route)[1, 32](cuda.to_device(EXP2_VALUES), out)
    return out.copy_to_host()


def expected_exp2(x):
    tiny = np.finfo(np.float32).tiny
    x = np.where(np.abs(x) < tiny, np.float32(0), x)
    with np.errstate(over="ignore", under="ignore"):
        y = np.exp2(x.astype(np.float64))
    y = np.where(y >= 2.0**128, np.inf, y)  # past fp32's range
    return np.where(np.abs(y) < tiny, 0.0, y)


def store_kernel(route: str):
    st_global_v4 = ptx.function("store.ptx", "flashcore_st_global_v4", route)

    @cuda.jit
    def scatter(words, slots, shift, out):
        # lane l stores its four words to 16-byte slot slots[l] of out, `shift` bytes further on
        lane = cuda.threadIdx.x
        st_global_v4(operands.global_address(out) + uint64(16 * slots[lane] + shift),
                     words[lane, 0], words[lane, 1], words[lane, 2], words[lane, 3])

    return scatter


def run_store(route, seed, shift=0):
    """32 lanes store 16 random bytes each to a permutation of slots 1 .. 32 of 34 (slots 0 and 33,
    where a store that wrote too much would land, keep their poison)."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 1 << 32, size=(32, 4), dtype=np.uint32)
    slots = (rng.permutation(32) + 1).astype(np.uint32)
    poison = np.full((34, 4), 0xDEADBEEF, np.uint32)
    out = cuda.to_device(poison)
    store_kernel(route)[1, 32](cuda.to_device(words), cuda.to_device(slots), np.uint32(shift), out)
    expected = poison.copy()
    expected[slots] = words
    return out.copy_to_host(), expected


def run_cp_async(route, seed):
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 1 << 16, size=(32, 16), dtype=np.uint16)
    src_bytes = np.array([16, 0, 8, 2] * 8, np.uint32)
    out = cuda.to_device(np.zeros((32, 16), np.uint16))
    cp_async_kernel(route)[1, 32](cuda.to_device(src), cuda.to_device(src_bytes), out)
    expected = src.copy()
    for lane, n in enumerate(src_bytes):
        expected[lane, n // 2:8] = 0
    return out.copy_to_host(), expected


def _on_gpu():
    from flashcore_numba.arch.sim import simulator_enabled

    return not simulator_enabled()


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_mma_fragments(kind):
    """D = A.B + C with the documented fragments (the emulation here, the hardware on a GPU)."""
    routes = ("link", "inline") if _on_gpu() else ("inline",)
    seed = int(np.random.default_rng().integers(1 << 31))
    results = [run_mma(kind, route, seed) for route in routes]
    for got, expected in results:
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=f"{kind} seed={seed}")
    if len(results) == 2:
        assert np.array_equal(results[0][0].view(np.uint32), results[1][0].view(np.uint32)), "routes differ"


@pytest.mark.parametrize("trans", [False, True], ids=["x4", "x4.trans"])
def test_ldmatrix_fragments(trans):
    M = np.random.default_rng().integers(0, 1 << 16, size=(16, 16), dtype=np.uint16)
    for route in (("link", "inline") if _on_gpu() else ("inline",)):
        out = cuda.to_device(np.zeros((32, 4), np.uint32))
        ldmatrix_kernel(trans, route)[1, 32](cuda.to_device(M), out)
        assert np.array_equal(out.copy_to_host(), expected_ldmatrix(M, trans)), f"{route} route"


def test_cp_async_copies_and_zero_fills():
    seed = int(np.random.default_rng().integers(1 << 31))
    for route in (("link", "inline") if _on_gpu() else ("inline",)):
        got, expected = run_cp_async(route, seed)
        assert np.array_equal(got, expected), f"{route} route, seed {seed}"


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_pack_rounds_to_nearest_even(kind):
    for route in (("link", "inline") if _on_gpu() else ("inline",)):
        got, lo, hi = run_pack(kind, route)
        assert np.array_equal(got, expected_pack(kind, lo, hi)), f"{route} route"


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_unpack_is_exact_and_undoes_pack(kind):
    """Random bit patterns (NaN and inf included) come back as the fp32 values NumPy reads from the
    same 16 bits, lower half first; packing them again gives the same bits (NaNs aside)."""
    from flashcore_numba.reference import bf16_to_float

    bits = np.random.default_rng().integers(0, 1 << 16, size=(64, 2), dtype=np.uint16)
    bits[0] = (0x7C00, 0xFC00) if kind == "f16" else (0x7F80, 0xFF80)  # +inf, -inf
    halves = bits.view(np.float16).astype(np.float32) if kind == "f16" else bf16_to_float(bits)
    packed = (bits[:, 1].astype(np.uint32) << 16) | bits[:, 0]
    for route in (("link", "inline") if _on_gpu() else ("inline",)):
        lo, hi = (cuda.to_device(np.full(64, 7.0, np.float32)) for _ in range(2))
        unpack_kernel(kind, route)[1, 64](cuda.to_device(packed), lo, hi)
        got = np.stack([lo.copy_to_host(), hi.copy_to_host()], axis=1)
        assert np.array_equal(got, halves, equal_nan=True), f"{route} route"
        finite = ~np.isnan(got).any(axis=1)
        assert np.array_equal(expected_pack(kind, got[finite, 0], got[finite, 1]), packed[finite]), f"{route} route"


def test_exp2_flushes_subnormals_and_is_within_its_error():
    """ex2.approx.ftz: within 2 units in the last place (rtol 2^-21), 2^-inf = 0, NaN stays NaN,
    and nothing subnormal in or out."""
    expected = expected_exp2(EXP2_VALUES)
    for route in (("link", "inline") if _on_gpu() else ("inline",)):
        got = run_exp2(route).astype(np.float64)
        assert np.array_equal(np.isnan(got), np.isnan(expected)), f"{route} route: NaN where none is due"
        finite = ~np.isnan(expected)
        np.testing.assert_allclose(got[finite], expected[finite], rtol=2.0**-21, atol=0, err_msg=f"{route} route")
        assert not ((got > 0) & (got < np.finfo(np.float32).tiny)).any(), f"{route} route: a subnormal result"


def test_st_global_v4_stores_four_words_in_order():
    """Word i of a lane lands at its address + 4 i, nothing outside the 16 bytes is touched."""
    seed = int(np.random.default_rng().integers(1 << 31))
    for route in (("link", "inline") if _on_gpu() else ("inline",)):
        got, expected = run_store(route, seed)
        assert np.array_equal(got, expected), f"{route} route, seed {seed}"


def red_kernel(route: str):
    red = ptx.function("red.ptx", "flashcore_red_add_f32", route)
    red_v2 = ptx.function("red.ptx", "flashcore_red_add_v2_f32", route)

    @cuda.jit
    def add_up(values, pair, shift, out):
        # every lane adds its value to float `lane % 4` of out (many lanes on one address), and
        # with `pair` its value and twice it to floats 4 + 2 (lane % 2) and the one after, `shift`
        # bytes further on
        lane = cuda.threadIdx.x
        base = operands.global_address(out)
        if pair:
            red_v2(base + uint64(16 + 8 * (lane % 2) + shift), values[lane], values[lane] * float32(2.0))
        else:
            red(base + uint64(4 * (lane % 4)), values[lane])

    return add_up


def run_red(route, pair, shift=0):
    values = np.arange(1, 33, dtype=np.float32)  # sums exact in float32, whatever the order
    out = cuda.to_device(np.full(10, 0.5, np.float32))
    red_kernel(route)[1, 32](cuda.to_device(values), pair, np.uint32(shift), out)
    expected = np.full(10, 0.5, np.float32)
    if pair:
        for lane in range(32):
            expected[4 + 2 * (lane % 2)] += values[lane]
            expected[5 + 2 * (lane % 2)] += 2 * values[lane]
    else:
        for lane in range(32):
            expected[lane % 4] += values[lane]
    return out.copy_to_host(), expected


def test_red_adds_every_lanes_value():
    """flashcore_red_add_f32: 32 lanes on four addresses, every addition kept; flashcore_red_add_v2_f32
    (sm_90 and on): x0 at the address, x1 four bytes on; nothing else touched."""
    routes = ("link", "inline") if _on_gpu() else ("inline",)
    for route in routes:
        for pair in (False, True):
            if pair and _on_gpu() and cuda.get_current_device().compute_capability < (9, 0):
                continue
            got, expected = run_red(route, pair)
            assert np.array_equal(got, expected), (route, pair, got, expected)


@pytest.mark.skipif(_on_gpu(), reason="on the GPU a misaligned vector reduction faults and spoils the context")
def test_red_v2_refuses_a_misaligned_address_in_the_simulator():
    with pytest.raises(Exception, match=r"8-byte aligned address, got byte offset \d+"):
        run_red("inline", True, shift=4)


@pytest.mark.skipif(_on_gpu(), reason="on the GPU a misaligned vector store faults and spoils the context")
def test_st_global_v4_refuses_a_misaligned_address_in_the_simulator():
    """The hardware faults on a store whose address is not a multiple of 16; the emulation raises, so a
    kernel that would fault on the GPU fails its CPU tests."""
    with pytest.raises(Exception, match=r"16-byte aligned address, got byte offset \d+"):
        run_store("inline", 0, shift=4)


# ---------------------------------------------------------------------------------------------
# wgmma (ptx/wgmma.ptx): one warpgroup multiplies tiles kept in the 128-byte swizzle layout,
# through descriptors; the emulation in the simulator, the hardware on an H100 (sm_90 only)
# ---------------------------------------------------------------------------------------------
def swizzled_order(tile: np.ndarray) -> np.ndarray:
    """A (64, D) tile of 16-bit values in the 128-byte swizzle layout of ptx/wgmma.ptx: atoms of
    64 columns, row r at r * 128 bytes, its 16-byte chunk c stored at chunk c ^ (r % 8)."""
    rows, cols = tile.shape
    out = np.zeros(rows * cols, np.uint16)
    for a in range(cols // 64):
        for r in range(rows):
            for c in range(8):
                dst = (a * rows * 128 + r * 128 + ((c ^ (r % 8)) * 16)) // 2
                out[dst:dst + 8] = tile[r, a * 64 + c * 8:a * 64 + c * 8 + 8]
    return out


def accumulator_registers(M: np.ndarray) -> np.ndarray:
    """(128, N/2): register 4j + e of thread 32w + lane = M[16w + g (+8 if e >= 2), 8j + 2t (+1 if e odd)]."""
    out = np.zeros((128, M.shape[1] // 2), M.dtype)
    for tid in range(128):
        w, g, t = tid // 32, (tid % 32) // 4, tid % 4
        for j in range(M.shape[1] // 8):
            for e in range(4):
                out[tid, 4 * j + e] = M[16 * w + g + 8 * (e >= 2), 8 * j + 2 * t + e % 2]
    return out


def a_fragments(P_bits: np.ndarray) -> np.ndarray:
    """(128, 4 k-steps) .b32: per k-step k, a0..a3 of mma.sync's A layout for the thread's warp rows."""
    steps = P_bits.shape[1] // 16
    out = np.zeros((128, 4 * steps), np.uint32)
    for tid in range(128):
        w, g, t = tid // 32, (tid % 32) // 4, tid % 4
        for k in range(steps):
            for e, (dr, dc) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
                r, c = 16 * w + g + dr, 16 * k + 2 * t + dc
                out[tid, 4 * k + e] = (int(P_bits[r, c + 1]) << 16) | int(P_bits[r, c])
    return out


def wgmma_kernel(head_dim: int, kind: str):
    qk = ptx.function("wgmma.ptx", f"flashcore_wgmma_qk_d{head_dim}_{kind}", "inline")
    pv = ptx.function("wgmma.ptx", f"flashcore_wgmma_pv_d{head_dim}_{kind}", "inline")
    fence = ptx.function("wgmma.ptx", "flashcore_fence_proxy_async", "inline")
    shared_address, descriptor, SW128 = operands.shared_address, operands.matrix_descriptor, operands.SWIZZLE_128B
    TILE = 64 * head_dim * 2  # bytes of one 64-row tile
    WORDS = 3 * TILE // 4

    @cuda.jit
    def products(tiles, frags, s_out, o_out):
        smem_h = cuda.shared.array(WORDS, uint32, alignment=1024)
        tid = cuda.threadIdx.x
        for i in range(WORDS // 128):
            smem_h[tid + i * 128] = tiles[tid + i * 128]
        fence()
        cuda.syncthreads()
        smem = shared_address(smem_h)
        s = qk(descriptor(smem, 16, 1024, SW128), descriptor(smem + TILE, 16, 1024, SW128))
        for i in range(32):
            s_out[tid, i] = s[i]
        f = frags
        o = pv(f[tid, 0], f[tid, 1], f[tid, 2], f[tid, 3], f[tid, 4], f[tid, 5], f[tid, 6], f[tid, 7],
               f[tid, 8], f[tid, 9], f[tid, 10], f[tid, 11], f[tid, 12], f[tid, 13], f[tid, 14], f[tid, 15],
               descriptor(smem + 2 * TILE, 64 * 128, 1024, SW128))
        for i in range(head_dim // 2):
            o_out[tid, i] = o[i]

    return products


def _on_hopper():
    return _on_gpu() and cuda.get_current_device().compute_capability == (9, 0)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_wgmma_tiles_through_descriptors(head_dim, kind):
    """S = Q.K^T (K-major descriptors) and P.V (P in registers, V MN-major), tiles swizzled, with
    the documented accumulator layout. On a GPU without wgmma (not sm_90) there is nothing to run it on."""
    if _on_gpu() and not _on_hopper():
        pytest.skip("wgmma needs an sm_90 GPU")
    from flashcore_numba.reference import bf16_bits, bf16_to_float

    rng = np.random.default_rng()
    q, k, v, p = (rng.standard_normal(shape).astype(np.float32) * scale for shape, scale in
                  (((64, head_dim), 1.0), ((64, head_dim), 1.0), ((64, head_dim), 1.0), ((64, 64), 0.3)))
    if kind == "f16":
        bits = [x.astype(np.float16).view(np.uint16) for x in (q, k, v, p)]
        q, k, v, p = (b.view(np.float16).astype(np.float64) for b in bits)
    else:
        bits = [bf16_bits(x).view(np.uint16) for x in (q, k, v, p)]
        q, k, v, p = (bf16_to_float(b).astype(np.float64) for b in bits)
    tiles = np.concatenate([swizzled_order(b) for b in bits[:3]]).view(np.uint32)
    s_out = cuda.to_device(np.full((128, 32), np.nan, np.float32))
    o_out = cuda.to_device(np.full((128, head_dim // 2), np.nan, np.float32))
    wgmma_kernel(head_dim, kind)[1, 128](cuda.to_device(tiles), cuda.to_device(a_fragments(bits[3])), s_out, o_out)
    np.testing.assert_allclose(s_out.copy_to_host(), accumulator_registers(q @ k.T), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(o_out.copy_to_host(), accumulator_registers(p @ v), rtol=1e-4, atol=1e-3)


def wgmma_128_keys_kernel(kind: str, issued: bool = False):
    """S = Q.K^T over 128 keys, then O += P.V in place, P and O passed as tuples (the tuples route).
    issued: both products issued before either is awaited (the _issue and wait functions)."""
    from flashcore_numba.phases.common import LOG2E  # noqa: F401 - the package's import order

    qk = ptx.function("wgmma.ptx", f"flashcore_wgmma_qk_d128_n128_{kind}", "inline")
    pv_acc = ptx.function("wgmma.ptx", f"flashcore_wgmma_pv_acc_d128_n128_{kind}", "inline", tuples=True)
    qk_issue = ptx.function("wgmma.ptx", f"flashcore_wgmma_qk_issue_d128_n128_{kind}", "inline")
    pv_acc_issue = ptx.function("wgmma.ptx", f"flashcore_wgmma_pv_acc_issue_d128_n128_{kind}", "inline",
                                tuples=True)
    wait_s = ptx.function("wgmma.ptx", "flashcore_wgmma_wait_s_n128", "inline", tuples=True)
    wait_o = ptx.function("wgmma.ptx", "flashcore_wgmma_wait_o_d128_n128", "inline", tuples=True)
    fence = ptx.function("wgmma.ptx", "flashcore_fence_proxy_async", "inline")
    shared_address, descriptor, SW128 = operands.shared_address, operands.matrix_descriptor, operands.SWIZZLE_128B
    Q_BYTES, KV_BYTES = 64 * 128 * 2, 128 * 128 * 2
    WORDS = (Q_BYTES + 2 * KV_BYTES) // 4

    @cuda.jit
    def products(tiles, frags, acc, s_out, o_out):
        smem_h = cuda.shared.array(0, uint32, alignment=1024)
        tid = cuda.threadIdx.x
        for i in range(WORDS // 128):
            smem_h[tid + i * 128] = tiles[tid + i * 128]
        fence()
        cuda.syncthreads()
        smem = shared_address(smem_h)
        desc_q, desc_k = descriptor(smem, 16, 1024, SW128), descriptor(smem + Q_BYTES, 16, 1024, SW128)
        desc_v = descriptor(smem + Q_BYTES + KV_BYTES, 128 * 128, 1024, SW128)
        p = operands.as_tuple(frags[tid], 32)  # this thread's 32 P fragments and 64 O registers
        o_in = operands.as_tuple(acc[tid], 64)
        if issued:  # S, then P.V behind it; S awaited first (wait_group 1), then both (0)
            s = qk_issue(desc_q, desc_k)
            o = pv_acc_issue(p, desc_v, o_in)
            s = wait_s(s)
            for i in range(64):
                s_out[tid, i] = s[i]
            o = wait_o(p, o)
        else:
            s = qk(desc_q, desc_k)
            for i in range(64):
                s_out[tid, i] = s[i]
            o = pv_acc(p, desc_v, o_in)
        for i in range(64):
            o_out[tid, i] = o[i]

    return products, (Q_BYTES + 2 * KV_BYTES)


@pytest.mark.parametrize("issued", [False, True], ids=["awaited", "issued"])
@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_wgmma_128_key_tiles_accumulate_in_place(kind, issued):
    """The 128-key functions: K and V in 128-row swizzle atoms (V's LBO 16384), S of 64 columns per
    thread, and O += P.V on the accumulator passed in, P's 32 fragments and O as tuples; issued:
    the same products by the _issue functions, awaited by wait_s and wait_o."""
    if _on_gpu() and not _on_hopper():
        pytest.skip("wgmma needs an sm_90 GPU")
    from flashcore_numba.phases.common import launch
    from flashcore_numba.reference import bf16_bits, bf16_to_float

    rng = np.random.default_rng()
    q, k, v, p = (rng.standard_normal(shape).astype(np.float32) * scale for shape, scale in
                  (((64, 128), 1.0), ((128, 128), 1.0), ((128, 128), 1.0), ((64, 128), 0.3)))
    if kind == "f16":
        bits = [x.astype(np.float16).view(np.uint16) for x in (q, k, v, p)]
        q, k, v, p = (b.view(np.float16).astype(np.float64) for b in bits)
    else:
        bits = [bf16_bits(x).view(np.uint16) for x in (q, k, v, p)]
        q, k, v, p = (bf16_to_float(b).astype(np.float64) for b in bits)
    o0 = rng.standard_normal((64, 128)).astype(np.float32)
    tiles = np.concatenate([swizzled_order(b) for b in bits[:3]]).view(np.uint32)
    s_out = cuda.to_device(np.full((128, 64), np.nan, np.float32))
    o_out = cuda.to_device(np.full((128, 64), np.nan, np.float32))
    kernel, smem_bytes = wgmma_128_keys_kernel(kind, issued)
    launch(kernel, 1, 128, smem_bytes, (cuda.to_device(tiles), cuda.to_device(a_fragments(bits[3])),
                                        cuda.to_device(accumulator_registers(o0)), s_out, o_out))
    np.testing.assert_allclose(s_out.copy_to_host(), accumulator_registers(q @ k.T), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(o_out.copy_to_host(), accumulator_registers(o0 + p @ v), rtol=1e-4, atol=1e-3)


def wgmma_backward_kernel(kind: str):
    """Phase 12's products (one warpgroup): dQ = dS.K over 128 keys (dq, then dq_acc on the second
    64 keys), both operands MN-major from shared memory, for one 64-column atom of a D = 128 K
    (`atom`); and O += P.V over 64 rows at D = 64 and 128 (pv_acc n64: dV += Pᵀ dO, dK += dSᵀ Q)."""
    dq = ptx.function("wgmma.ptx", f"flashcore_wgmma_dq_{kind}", "inline")
    dq_acc = ptx.function("wgmma.ptx", f"flashcore_wgmma_dq_acc_{kind}", "inline", tuples=True)
    pv64 = ptx.function("wgmma.ptx", f"flashcore_wgmma_pv_acc_d64_n64_{kind}", "inline", tuples=True)
    pv128 = ptx.function("wgmma.ptx", f"flashcore_wgmma_pv_acc_d128_n64_{kind}", "inline", tuples=True)
    fence = ptx.function("wgmma.ptx", "flashcore_fence_proxy_async", "inline")
    shared_address, descriptor, SW128 = operands.shared_address, operands.matrix_descriptor, operands.SWIZZLE_128B
    DS_BYTES, K_HALF = 128 * 64 * 2, 64 * 128 * 2  # dSᵀ: 128 keys x 64 query rows; K: two 64-key tiles of D = 128
    V128 = DS_BYTES + 2 * K_HALF  # after dSᵀ and K: V (64 x 128), then V's first 64 columns (64 x 64)
    V64 = V128 + 64 * 128 * 2
    BYTES = V64 + 64 * 64 * 2

    @cuda.jit
    def products(tiles, frags, acc64, acc128, atom, dq_out, o64_out, o128_out):
        smem_h = cuda.shared.array(0, uint32, alignment=1024)
        tid = cuda.threadIdx.x
        for i in range(BYTES // 4 // 128):
            smem_h[tid + i * 128] = tiles[tid + i * 128]
        fence()
        cuda.syncthreads()
        smem = shared_address(smem_h)
        k_atom = smem + DS_BYTES + atom * 64 * 128  # this atom (64 columns of d) of the first 64 keys
        first = dq(descriptor(smem, 64 * 128, 1024, SW128), descriptor(k_atom, 64 * 128, 1024, SW128))
        c = dq_acc(descriptor(smem + 64 * 128, 64 * 128, 1024, SW128),
                   descriptor(k_atom + K_HALF, 64 * 128, 1024, SW128), first)
        for i in range(32):
            dq_out[tid, i] = c[i]
        p = operands.as_tuple(frags[tid], 16)  # 4 k-steps of P's A fragments
        o = pv64(p, descriptor(smem + V64, 64 * 128, 1024, SW128), operands.as_tuple(acc64[tid], 32))
        for i in range(32):
            o64_out[tid, i] = o[i]
        o = pv128(p, descriptor(smem + V128, 64 * 128, 1024, SW128), operands.as_tuple(acc128[tid], 64))
        for i in range(64):
            o128_out[tid, i] = o[i]

    return products, BYTES


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("atom", [0, 1])
def test_wgmma_backward_products(kind, atom):
    """Phase 12's dQ = dS.K: dSᵀ (a row per key) and K (a row per key, D = 128: two 64-column atoms)
    both read MN-major (trans-a and trans-b), 128 keys in two calls (dq, dq_acc), a 64-column atom
    of d each; and O += P.V over a 64-row tile at D = 64 and 128 (pv_acc n64), on the accumulator
    passed in."""
    if _on_gpu() and not _on_hopper():
        pytest.skip("wgmma needs an sm_90 GPU")
    from flashcore_numba.phases.common import launch
    from flashcore_numba.reference import bf16_bits, bf16_to_float

    rng = np.random.default_rng()
    ds_t, k, v, p = (rng.standard_normal(shape).astype(np.float32) * scale for shape, scale in
                     (((128, 64), 0.3), ((128, 128), 1.0), ((64, 128), 1.0), ((64, 64), 0.3)))
    if kind == "f16":
        bits = [x.astype(np.float16).view(np.uint16) for x in (ds_t, k, v, p)]
        ds_t, k, v, p = (b.view(np.float16).astype(np.float64) for b in bits)
    else:
        bits = [bf16_bits(x).view(np.uint16) for x in (ds_t, k, v, p)]
        ds_t, k, v, p = (bf16_to_float(b).astype(np.float64) for b in bits)
    # dSᵀ as one 128-row atom; K as two 64-key tiles of two atoms each (phase 12's layout); V at D = 128, then its
    # first 64 columns as a tile of D = 64
    tiles = np.concatenate([swizzled_order(bits[0]), swizzled_order(bits[1][:64]), swizzled_order(bits[1][64:]),
                            swizzled_order(bits[2]), swizzled_order(np.ascontiguousarray(bits[2][:, :64]))])
    o0 = rng.standard_normal((64, 128)).astype(np.float32)  # O's registers passed in (o0's first 64 columns at D = 64)
    o0_64 = np.ascontiguousarray(o0[:, :64])
    out = [cuda.to_device(np.full((128, n), np.nan, np.float32)) for n in (32, 32, 64)]
    kernel, smem_bytes = wgmma_backward_kernel(kind)
    launch(kernel, 1, 128, smem_bytes, (cuda.to_device(tiles.view(np.uint32)), cuda.to_device(a_fragments(bits[3])),
                                        cuda.to_device(accumulator_registers(o0_64)),
                                        cuda.to_device(accumulator_registers(o0)), np.int32(atom), *out))
    cols = slice(64 * atom, 64 * atom + 64)
    for got, want in zip(out, (ds_t.T @ k[:, cols], o0_64 + p @ v[:, :64], o0 + p @ v), strict=True):
        np.testing.assert_allclose(got.copy_to_host(), accumulator_registers(want), rtol=1e-4, atol=1e-3)


def test_the_wgmma_emulation_refuses_threads_that_name_other_operands():
    """The simulator computes a wgmma once for its warpgroup (every thread takes its registers from
    one product), so a thread that passes other descriptors than the first one's (undefined on the
    GPU) raises instead of silently getting a product of other operands."""
    if _on_gpu():
        pytest.skip("the simulator's emulation (on the GPU the instruction has no such check)")
    qk = ptx.function("wgmma.ptx", "flashcore_wgmma_qk_d64_f16", "inline")
    shared_address, descriptor, SW128 = operands.shared_address, operands.matrix_descriptor, operands.SWIZZLE_128B

    @cuda.jit
    def divergent(out):
        smem_h = cuda.shared.array(4096, uint32, alignment=1024)
        smem = shared_address(smem_h)
        tid = cuda.threadIdx.x
        other = 8192 if tid == 37 else 0  # one thread's B names the other tile
        s = qk(descriptor(smem, 16, 1024, SW128), descriptor(smem + other, 16, 1024, SW128))
        out[tid] = s[0]

    with pytest.raises(RuntimeError, match="descriptors differ from those of the warpgroup's first thread"):
        divergent[1, 128](cuda.to_device(np.zeros(128, np.float32)))


def test_tuples_route_groups_numbered_parameters():
    fn = ptx.load("wgmma.ptx")["flashcore_wgmma_pv_acc_d128_n128_f16"]
    assert fn.param_groups() == [("frag", "b32", 32), ("desc_v", "b64", 1), ("acc", "f32", 64)]
    from numba import types

    sig = fn.tuple_signature()
    assert sig.args == (types.UniTuple(types.uint32, 32), types.uint64, types.UniTuple(types.float32, 64))
    assert sig.return_type == types.UniTuple(types.float32, 64)
    with pytest.raises(ValueError, match="tuples: only the inline route"):
        ptx.function("wgmma.ptx", "flashcore_wgmma_pv_acc_d128_n128_f16", "link", tuples=True)


def test_issued_wgmma_registers_are_named_in_place():
    """An _issue function's inline text names the asm operands in the wgmma itself: no `mov` reads
    an accumulator after the commit. O's registers are tied (in and out); P's are inputs read in
    place; the descriptor, which the body steps on, keeps its `mov`."""
    fn = ptx.load("wgmma.ptx")["flashcore_wgmma_pv_acc_issue_d64_n128_f16"]
    assert fn.leaves_in_flight and not fn.awaits_in_flight
    asm, constraints = fn.inline_asm()
    parts = constraints.split(",")
    n_out = 32
    assert parts[:n_out] == ["=f"] * n_out
    assert parts[n_out:n_out + 32] == ["r"] * 32 and parts[n_out + 32] == "l"
    assert parts[n_out + 33:n_out + 33 + 32] == [str(j) for j in range(32)], "O tied: in and out one register"
    assert "{$0, $1, $2," in asm and "{$32, $33, $34, $35}" in asm
    assert "mov.b64 %dv, $64;" in asm
    assert "%o" not in asm.split("wgmma.fence")[1] and "%frag" not in asm.split("wgmma.fence")[1]
    after_commit = asm.split("wgmma.commit_group.sync.aligned;")[1]
    assert "mov" not in after_commit and "wait_group" not in asm
    s = ptx.load("wgmma.ptx")["flashcore_wgmma_qk_issue_d128_n128_f16"]
    assert s.inline_asm()[1].split(",")[:64] == ["=f"] * 64


def test_a_complete_wgmma_named_in_place_copies_no_accumulator():
    """in_place on a function that awaits its own wgmma (pv_acc: fence, k-steps, commit, wait): the
    accumulator's 64 registers are the operands, tied in and out, where the usual text copies each
    in and out by a `mov` (128 of them); the wait stays in the body, and the route is the inline one."""
    fn = ptx.load("wgmma.ptx")["flashcore_wgmma_pv_acc_d128_n64_f16"]
    assert not fn.leaves_in_flight and not fn.awaits_in_flight
    usual, _ = fn.inline_asm()
    assert usual.count("mov.f32") == 128
    asm, constraints = fn.inline_asm(in_place=True)
    parts = constraints.split(",")
    assert parts[:64] == ["=f"] * 64 and parts[64:80] == ["r"] * 16 and parts[80] == "l"
    assert parts[81:145] == [str(j) for j in range(64)], "the accumulator tied: in and out one register"
    assert "mov.f32" not in asm and "{$0, $1, $2," in asm and "wgmma.wait_group.sync.aligned 0;" in asm
    with pytest.raises(ValueError, match="in_place: only the inline route"):
        ptx.function("wgmma.ptx", "flashcore_wgmma_pv_acc_d128_n64_f16", "link", in_place=True)


def test_wait_functions_wait_before_reading_their_parameters():
    for name in ("flashcore_wgmma_wait_s_n128", "flashcore_wgmma_wait_o_d64_n128", "flashcore_wgmma_wait_o_d128_n128"):
        fn = ptx.load("wgmma.ptx")[name]
        assert fn.awaits_in_flight and not fn.leaves_in_flight
        asm, _ = fn.inline_asm()
        assert asm.index("wgmma.wait_group") < asm.index("mov."), f"{name}: a parameter read before the wait"


@pytest.mark.parametrize("name", ["flashcore_wgmma_qk_issue_d64_n128_f16", "flashcore_wgmma_wait_s_n128"])
def test_in_flight_functions_are_refused_on_the_link_route(name):
    with pytest.raises(ValueError, match="route: .*in flight"):
        ptx.function("wgmma.ptx", name, "link")


def test_register_arrays_travel_as_tuples_in_c_order():
    """operands.as_tuple reads a local array's first n elements in C order; operands.store_tuple writes a
    tuple back the same way (what phase 09 passes to and takes from the tuples route)."""
    as_tuple, store_tuple = operands.as_tuple, operands.store_tuple

    @cuda.jit
    def kernel(out_tuple, out_array):
        a = cuda.local.array((2, 4), float32)
        for r in range(2):
            for c in range(4):
                a[r, c] = float32(10 * r + c + cuda.threadIdx.x)
        t = as_tuple(a, 6)  # (a[0, 0..3], a[1, 0..1])
        for i in range(6):
            out_tuple[cuda.threadIdx.x, i] = t[i]
        b = cuda.local.array((2, 4), float32)
        for r in range(2):
            for c in range(4):
                b[r, c] = float32(-1.0)
        store_tuple(b, t)
        for r in range(2):
            for c in range(4):
                out_array[cuda.threadIdx.x, r, c] = b[r, c]

    out_tuple = cuda.to_device(np.full((2, 6), np.nan, np.float32))
    out_array = cuda.to_device(np.full((2, 2, 4), np.nan, np.float32))
    kernel[1, 2](out_tuple, out_array)
    for tid in range(2):
        a = np.array([[10 * r + c + tid for c in range(4)] for r in range(2)], np.float32)
        np.testing.assert_array_equal(out_tuple.copy_to_host()[tid], a.reshape(-1)[:6])
        expected = np.full(8, -1.0, np.float32)
        expected[:6] = a.reshape(-1)[:6]
        np.testing.assert_array_equal(out_array.copy_to_host()[tid], expected.reshape(2, 4))


# ---------------------------------------------------------------------------------------------
# Phase 08 compiled for the H100: no spill, no call (a call would serialize every wgmma)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[(64, "float16"), (128, "float16"), (64, "bfloat16"), (128, "bfloat16")],
                ids=["D=64 fp16", "D=128 fp16", "D=64 bf16", "D=128 bf16"])
def phase08_report(request, background):
    return compiled(request, background)["08"]


@pytest.mark.slow
def test_phase08_has_no_spill_and_wgmmas_run_asynchronously(phase08_report):
    r = phase08_report
    where = f"phase 08 D={r['head_dim']} {r['dtype']}"
    assert (r["spill_store_bytes"], r["spill_load_bytes"], r["stack_frame_bytes"]) == (0, 0, 0), (
        f"{where}: {r['stack_frame_bytes']} B stack, {r['spill_store_bytes']} B spill stores "
        f"({r['registers']} registers)")
    assert "st.local" not in r["ptx"] and "ld.local" not in r["ptx"]
    # ptxas serializes the wgmmas of a kernel that calls a subroutine (a 64-bit integer or an IEEE
    # float division is one) and says so with warning C7509/C7510
    assert "wgmma.mma_async instructions are serialized" not in r["assembler_log"], where
    assert ".target sm_90a" in r["ptx"] and "wgmma.mma_async.sync.aligned.m64n64k16" in r["ptx"]
    assert_scores_take_one_ex2(r["ptx"], scores=32, where=where)


# ---------------------------------------------------------------------------------------------
# Phase 09 compiled for the H100 as Numba links it (LTO): the launch registers fit one block per
# SM, setmaxnreg is kept, no spill, no serialized wgmma
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[(64, "float16"), (128, "float16"), (128, "bfloat16")],
                ids=["D=64 fp16", "D=128 fp16", "D=128 bf16"])
def phase09_report(request, background):
    return compiled(request, background)["09"]


@pytest.mark.slow
def test_phase09_trades_registers_without_spilling(phase09_report):
    r = phase09_report
    where = f"phase 09 D={r['head_dim']} {r['dtype']}"
    n_threads = r["n_threads"]
    assert r["registers"] * n_threads <= 65536, f"{where}: {r['registers']} registers x {n_threads} threads"
    assert (r["spill_store_bytes"], r["spill_load_bytes"], r["stack_frame_bytes"]) == (0, 0, 0), (
        f"{where}: {r['stack_frame_bytes']} B stack, {r['spill_store_bytes']} B spill stores "
        f"({r['registers']} registers)")
    assert ".maxntid" in r["ptx"] and ".minnctapersm 1" in r["ptx"], "the launch bounds setmaxnreg needs"
    assert "setmaxnreg.inc" in r["ptx"] and "setmaxnreg.dec" in r["ptx"]
    # C7504: ptxas dropped setmaxnreg (it did when the kernel was assembled from PTX as one unit of many)
    assert "C7504" not in r["assembler_log"] and "C7508" not in r["assembler_log"], where
    assert "wgmma.mma_async instructions are serialized" not in r["assembler_log"], where
    assert "cp.async.bulk.tensor.3d" in r["ptx"] and "mbarrier.try_wait.parity" in r["ptx"]
    assert_scores_take_one_ex2(r["ptx"], scores=64, where=where)


def _issued_registers_touched_before_their_wait(text: str) -> dict:
    """For each inline block of a PTX that issues wgmma without waiting: the lines between it and
    its wait (wait_group 1 for S, 0 for a P.V, which reads P's fragments too) that name one of
    the registers it writes or reads. Inline blocks in between are skipped (their operands
    are the kernel's registers only through the asm operands, checked by their own text)."""
    lines = text.splitlines()
    found = {}
    i = 0
    while i < len(lines):
        if "begin inline asm" not in lines[i]:
            i += 1
            continue
        j = next(k for k in range(i, len(lines)) if "end inline asm" in lines[k])
        block = "\n".join(lines[i:j])
        if "wgmma.commit_group" in block and "wgmma.wait_group" not in block:
            registers = set()
            for m in re.finditer(r"wgmma\.mma_async[^{]*\{([^}]*)\}(,\s*\{([^}]*)\})?", block):
                registers |= set(re.findall(r"%[fr]\d+", m.group(1) + (m.group(3) or "")))
            wait = "wgmma.wait_group.sync.aligned 0" if any(r.startswith("%r") for r in registers) \
                else "wgmma.wait_group"
            touched, k, inside = [], j + 1, False
            while wait not in lines[k]:
                inside = inside or "begin inline asm" in lines[k]
                if not inside and set(re.findall(r"%[fr]\d+", lines[k])) & registers:
                    touched.append(lines[k].strip())
                inside = inside and "end inline asm" not in lines[k]
                k += 1
            found[i] = touched
        i = j + 1
    return found


def test_in_flight_check_finds_a_copy_before_the_wait():
    text = ("// begin inline asm\n{\nwgmma.fence.sync.aligned;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16\n"
            "{%f1, %f2}, %rd1, %rd2, p, 1, 1, 0, 0;\nwgmma.commit_group.sync.aligned;\n}\n// end inline asm\n"
            "add.f32 %f7, %f8, %f9;\n{0}\n// begin inline asm\nwgmma.wait_group.sync.aligned 1;\n// end inline asm\n")
    assert list(_issued_registers_touched_before_their_wait(text.replace("{0}", "")).values()) == [[]]
    found = _issued_registers_touched_before_their_wait(text.replace("{0}", "mov.f32 %f5, %f2;"))
    assert list(found.values()) == [["mov.f32 %f5, %f2;"]]


@pytest.mark.slow
def test_phase09_overlaps_its_softmax_with_its_own_products(phase09_report):
    """S and P.V are issued, S awaited alone (wait_group 1), the softmax runs, then P.V is awaited
    (wait_group 0); between an issue and its wait no instruction names a register in flight."""
    r = phase09_report
    where = f"phase 09 D={r['head_dim']} {r['dtype']}"
    assert "wgmma.wait_group.sync.aligned 1" in r["ptx"], f"{where}: no overlap"
    touched = _issued_registers_touched_before_their_wait(r["ptx"])
    loops = 2  # the loop over the tiles no row masks, and the masked tiles' own
    assert len(touched) == 2 * loops, (f"{where}: expected two issued products (S, P.V) in each of {loops} "
                                       f"loops, found {len(touched)}")
    assert all(not lines for lines in touched.values()), f"{where}: in-flight registers touched: {touched}"
