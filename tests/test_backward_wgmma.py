"""Phase 12 (phases/p12_backward_wgmma.py): phase 11's backward with its kv_kernel on wgmma. dQ, dK
and dV against the float64 reference's gradients in the simulator on small shapes (the GPU's blocks:
two warpgroups, 128 keys, query tiles of 128 rows at D = 64 and 64 at D = 128), the kernels
compiled for the H100 (sm_90a, no GPU needed), and on a GPU against torch's autograd and phase 11."""

import sys

import numpy as np
import pytest

from flashcore_numba.reference import random_qkv, reference_attention, reference_lse, round_to

from test_backward import GPU_CASES, both_references, close_to_torchs_gradients, gradients_close, run_backward

NO_TORCH = "torch is not installed (pip install -e '.[torch]')"  # the GPU tests need it


def run_wgmma_backward(q, k, v, o, do, lse, dtype="float16", **kw):
    """p12_backward_wgmma.backward on 16-bit copies, as run_backward runs phase 11's."""
    from flashcore_numba.phases import p12_backward_wgmma

    return run_backward(q, k, v, o, do, lse, dtype, backward=p12_backward_wgmma.backward, **kw)


CASES = [
    # rows 64-99 and keys 64-71: the second warpgroup's keys, dSᵀ's second atom of query rows and the
    # second warpgroup's piece of dQ all carry data (a partial tile of each)
    pytest.param((1, 1, 100, 64), 72, 1, True, False, id="causal, partial tiles past 64 rows and keys"),
    pytest.param((1, 4, 5, 64), 9, 2, True, True, id="GQA 2, causal, S_q < S_k, deterministic"),
    pytest.param((1, 2, 26, 64), 11, 1, True, False, id="MQA, causal, rows without keys",
                 marks=pytest.mark.slow),  # phase 11's rows without keys run by default (test_backward)
    pytest.param((1, 2, 18, 128), 17, 2, False, False, id="D=128"),
    # two query tiles of 64 rows: the serial build's dQ one tile late, from both dSᵀ buffers
    pytest.param((1, 1, 70, 128), 30, 1, False, True, id="D=128, deterministic, two query tiles",
                 marks=pytest.mark.slow),
    pytest.param((1, 2, 33, 64), 40, 1, True, False, id="bf16, MQA, causal", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("shape, seq_k, heads_kv, causal, deterministic", CASES)
def test_wgmma_backward_matches_the_reference_gradients(shape, seq_k, heads_kv, causal, deterministic, request):
    """Phase 11's cases on phase 12's kv_kernel: dQ (atomics, or deterministic), dK and dV summed
    over each group, the causal mask (rows that see no key give nothing), S_q != S_k, D = 128 (dQ's
    pieces by columns, not rows), bf16, a scale that is not 1/sqrt(D)."""
    dtype = "bfloat16" if "bf16" in request.node.callspec.id else "float16"
    q, k, v = (round_to(x, dtype) for x in random_qkv(shape, seq_k, heads_kv=heads_kv, dtype=np.float32))
    do = round_to(np.random.default_rng().standard_normal(q.shape), dtype)
    o = reference_attention(q, k, v, causal=causal, scale=0.3)
    lse = reference_lse(q, k, causal=causal, scale=0.3)
    got = run_wgmma_backward(q, k, v, o, do, lse, dtype, causal=causal, scale=0.3, deterministic=deterministic)
    gradients_close(got, *both_references(q, k, v, do, dtype, causal=causal, scale=0.3))


@pytest.mark.parametrize("deterministic", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_wgmma_backward_over_several_blocks_and_tiles(deterministic):
    """Three key blocks (128 keys, 128 and 4) and two query tiles of 64 rows (D = 128), causal with
    S_q < S_k: the first two key blocks are seen from the first query tile on, the last only from
    the second, where its walk starts (m_first). deterministic: in two parts, so that one block
    walks two key blocks (0 and 2) and the parts are summed."""
    q, k, v = (round_to(x, "float16") for x in random_qkv((1, 1, 70, 128), 260, heads_kv=1, dtype=np.float32))
    do = round_to(np.random.default_rng().standard_normal(q.shape), "float16")
    o, lse = reference_attention(q, k, v, causal=True), reference_lse(q, k, causal=True)
    got = run_wgmma_backward(q, k, v, o, do, lse, causal=True, deterministic=deterministic,
                             parts=2 if deterministic else None)
    gradients_close(got, *both_references(q, k, v, do, causal=True))


@pytest.mark.parametrize("D, shape, seq_k, heads_kv, causal, dtype", [
    pytest.param(64, (1, 4, 150, 64), 140, 2, True, "float16", id="D=64 GQA 2 causal: a tile's second piece past the rows",
                 marks=pytest.mark.slow),
    pytest.param(128, (2, 2, 70, 128), 200, 1, False, "bfloat16", id="D=128 MQA bf16: pieces by columns",
                 marks=pytest.mark.slow),
    pytest.param(96, (1, 2, 19, 96), 23, 1, True, "float16", id="D=96 rounded up: pieces by columns"),
])
def test_the_bulk_dq_build_matches_the_reference_gradients(D, shape, seq_k, heads_kv, causal, dtype):
    """The build "bulk dQ" (DqOfTiles): each warpgroup's 64 x 64 piece of dQ staged in shared
    memory (swizzled) and added to a workspace of whole pieces by one bulk reduction, then dQ written
    from the workspace. At D = 64 a tile's two pieces are its two halves of rows (the second of the
    last tile lies past S_q and is skipped); at D = 128 its two halves of columns. deterministic=True
    on the same build runs the serial kernel and phase 12's reductions, and gives the same gradients."""
    from flashcore_numba.phases import p12_backward_wgmma as p12

    bw = p12.build(D, dtype, bulk_dq=True)
    assert bw.dq_of_tiles is not None and "bulk dQ" in bw.cache_id("12-kv")
    assert p12.smem_bytes(D) + 2 * p12.PIECE_BYTES == bw.kv["SMEM_BYTES"] + p12.STATIC_SMEM_BYTES
    q, k, v = (round_to(x, dtype) for x in random_qkv(shape, seq_k, heads_kv=heads_kv, dtype=np.float32))
    do = round_to(np.random.default_rng().standard_normal(q.shape), dtype)
    o = reference_attention(q, k, v, causal=causal, scale=0.3)
    lse = reference_lse(q, k, causal=causal, scale=0.3)
    want = both_references(q, k, v, do, dtype, causal=causal, scale=0.3)
    for deterministic in (False, True):
        got = run_wgmma_backward(q, k, v, o, do, lse, dtype, causal=causal, scale=0.3, deterministic=deterministic,
                                 bulk_dq=True)
        gradients_close(got, *want)


@pytest.mark.parametrize("D, bulk_dq, S", [pytest.param(64, True, 30, id="D=64 with bulk dQ"),
                                           pytest.param(64, True, 150, id="D=64 with bulk dQ, 2 tiles",
                                                        marks=pytest.mark.slow),
                                           pytest.param(128, False, 150, id="D=128", marks=pytest.mark.slow)])
def test_the_overlap_build_matches_the_reference_gradients(D, bulk_dq, S):
    """The build "overlap": Sᵀ and dPᵀ issued back to back (qk_issue) and handed back by wait_s and
    wait_last; with atomics and deterministic, GQA 2, causal with tails (at D = 64 with bulk dQ too)."""
    from flashcore_numba.phases import p12_backward_wgmma as p12

    assert p12.build(D, overlap=True, tied=False).cache_id("12-kv")[-1] == "overlap"
    # "tied" (accumulators named in place; its products are the same in the simulator), the default
    # build of both phases, and the build it replaced ("red", tied=False) are entries of their own
    from flashcore_numba.phases import p13_backward_ws as p13

    assert p12.build(D).cache_id("12-kv")[-1] == "tied" and "tied" not in p12.build(D, tied=False).cache_id("12-kv")
    assert p13.build(D).cache_id("13-kv")[-1] == "tied" and "tied" not in p13.build(D, tied=False).cache_id("13-kv")
    q, k, v = (round_to(x, "float16") for x in random_qkv((1, 4, S, D), S - 10, heads_kv=2, dtype=np.float32))
    do = round_to(np.random.default_rng().standard_normal(q.shape), "float16")
    o, lse = reference_attention(q, k, v, causal=True, scale=0.3), reference_lse(q, k, causal=True, scale=0.3)
    want = both_references(q, k, v, do, causal=True, scale=0.3)
    for deterministic in (False, True):
        got = run_wgmma_backward(q, k, v, o, do, lse, causal=True, scale=0.3, deterministic=deterministic,
                                 bulk_dq=bulk_dq, overlap=True)
        gradients_close(got, *want)


def test_wgmma_backward_takes_the_gradient_of_the_lse():
    """dLSE joins dS as in phase 11 (Δ's kernel is phase 11's): with it the gradients match."""
    q, k, v = random_qkv((1, 2, 12, 64), 30, heads_kv=1)
    rng = np.random.default_rng()
    do = rng.standard_normal(q.shape).astype(np.float16)
    dlse = rng.standard_normal(q.shape[:3]).astype(np.float32)
    o, lse = reference_attention(q, k, v, causal=True), reference_lse(q, k, causal=True)
    got = run_wgmma_backward(q, k, v, o, do, lse, causal=True, dlse=dlse)
    gradients_close(got, *both_references(q, k, v, do, causal=True, dlse=dlse))


def test_wgmma_backward_refuses_what_it_cannot_build():
    from flashcore_numba.phases import p12_backward_wgmma as p12

    for D in (100, 136, 256):  # past 128 phase 11 splits the gradients' columns; this phase does not
        with pytest.raises(ValueError, match=f"head dim: the backward is built for multiples of 8 up to 128, not {D}"):
            p12.build(D)
    with pytest.raises(ValueError, match="cc: phase 12 runs on compute capability 9.0 only"):
        p12.build(64, cc=(8, 0))
    with pytest.raises(ValueError, match="dtype: the backward builds float16 and bfloat16"):
        p12.build(64, "float32")


def test_wgmma_backward_layout_fits_the_h100():
    """The full-size blocks: two warpgroups of 64 keys, query tiles of 128 rows at D = 64 and 64 at
    D = 128; shared memory (K, V, two stages of Q and dO, dSᵀ (two buffers at D = 128), the rows' stats) within the 227 KB an
    H100 gives a block, and every dQ piece of a tile dealt out, one per warpgroup."""
    from flashcore_numba.arch.smem import smem_per_block
    from flashcore_numba.phases import p12_backward_wgmma as p12

    for D, block_m in ((64, 128), (128, 64)):
        L = p12.layout(D, p12.WARPGROUPS, p12.query_rows(D))
        assert (L["OWN_ROWS"], L["BLOCK_M"], L["N_THREADS"], L["WG_PIECES"]) == (128, block_m, 256, 1)
        assert p12.smem_bytes(D) <= smem_per_block((9, 0))
    # D = 64: K and V (32 KB), two stages of Q and dO (64 KB), dSᵀ (32 KB); D = 128: K and V (64 KB),
    # the stages (64 KB), two dSᵀ buffers (16 KB each: the serial build's dQ one tile late)
    assert (p12.smem_bytes(64), p12.smem_bytes(128)) == (128 * 1024 + p12.STATIC_SMEM_BYTES,
                                                         160 * 1024 + p12.STATIC_SMEM_BYTES)
    L64, L128 = (p12.layout(D, p12.WARPGROUPS, p12.query_rows(D)) for D in (64, 128))
    assert [p12.dq_late(serial, L) for L in (L64, L128) for serial in (False, True)] == [False, False, False, True]


# ---------------------------------------------------------------------------------------------
# Compiled for the H100 (sm_90a), no GPU needed
# ---------------------------------------------------------------------------------------------
KERNELS = ("12-kv", "12-kv-serial")


def _compile_wgmma_backward():
    from flashcore_numba.measure.machine_code import kernel_reports

    return {D: kernel_reports(list(KERNELS), D) for D in (64, 128)}


def start_background(items, pool):
    """The sm_90a compiles (a subprocess in the simulator) in the session's pool of background jobs
    (conftest.py), if a selected test of this module reads them."""
    this_module = sys.modules[__name__]
    if any(getattr(item, "module", None) is this_module and "wgmma_backward_reports" in item.fixturenames
           for item in items):
        return pool.submit(_compile_wgmma_backward)
    return None


@pytest.fixture(scope="module")
def wgmma_backward_reports(background):
    if background is None or background.cancel():
        return _compile_wgmma_backward()
    return background.result()


@pytest.mark.slow
def test_wgmma_backward_kernels_compiled_for_the_h100(wgmma_backward_reports):
    """kv_kernel multiplies on wgmma only (no mma.sync, no ldmatrix), its wgmmas run asynchronously
    (ptxas serializes every wgmma of a kernel that makes a call: a 64-bit division would), dQ by
    reductions two columns at a time. Both builds run at the edge of the register file (Sᵀ, dPᵀ, dK
    and dV take 192 of 255): assembled as numba-cuda loads them (from the LTO-IR), the default build
    spills a few words at D = 64 as well as at D = 128 (32 bytes at 255 registers at D = 64; the
    report assembled from the PTX alone, which this test read before, had none), bounded here so
    that more would be seen."""
    for D, reports in wgmma_backward_reports.items():
        for kernel_id, r in reports.items():
            where = f"{kernel_id} D={D}: {r['registers']} registers, {r['spill_store_bytes']} B spilled"
            assert "wgmma.mma_async instructions are serialized" not in r["assembler_log"], where
            ptx = r["ptx"]
            assert "wgmma.mma_async.sync.aligned" in ptx and "mma.sync" not in ptx and "ldmatrix" not in ptx, where
            assert "red.global.add.v2.f32" in ptx and "atom.global" not in ptx, where
            spill = max(r["spill_store_bytes"], r["spill_load_bytes"], r["stack_frame_bytes"])
            assert spill <= 64, where


# ---------------------------------------------------------------------------------------------
# On a GPU (Hopper: wgmma exists there alone), through the backward's plan as `flashcore bench
# --backward` runs phase 12 (torch_ops.attention_backward)
# ---------------------------------------------------------------------------------------------
WGMMA_CASES = [case for case in GPU_CASES if case.values[0][3] <= 128]  # phases 12 and 13 build D up to 128


def _on_hopper():
    from numba import cuda

    return cuda.get_current_device().compute_capability == (9, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("phase", ["12", "13"])
@pytest.mark.parametrize("shape, seq_k, heads_kv, causal, dtype", WGMMA_CASES)
def test_wgmma_backward_matches_torch_on_gpu(shape, seq_k, heads_kv, causal, dtype, phase):
    """Phase 12's gradients (phase 11's plan with the wgmma kv_kernel, full-size blocks: two
    warpgroups, 128 keys, query tiles of 128 rows at D = 64), and phase 13's (the plan's tensor
    maps too), by the GPU tests' rule against torch's float64 autograd, from attention()'s forward
    output and log-sum-exp. Twice, on new tensors the second time: the same plan, other addresses
    (phase 13: other tensor maps)."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    if not _on_hopper():
        pytest.skip("phases 12 and 13 run on Hopper (sm_90) alone")
    from flashcore_numba import attention
    from flashcore_numba.runtime import torch_ops

    for _ in range(2):
        q, k, v = (torch.tensor(x, device="cuda").to(getattr(torch, dtype))
                   for x in random_qkv(shape, seq_k, heads_kv=heads_kv, dtype=np.float32))
        do = torch.randn(q.shape, device="cuda", dtype=q.dtype)
        out, lse = attention(q, k, v, causal=causal, scale=0.2, return_lse=True)
        got = torch_ops.attention_backward(q, k, v, out, lse, do, None, causal, 0.2, False, phase)
        close_to_torchs_gradients(list(got), q, k, v, do, causal, 0.2, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("phase", ["12", "13"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_wgmma_backward_deterministic_is_bit_identical_on_gpu(head_dim, phase):
    """deterministic=True on phase 12's (and 13's) serial build: the same bits twice (8 (batch, K/V head) pairs,
    3 key blocks of 128: dQ in parts), close to its atomics' gradients and to phase 11's. At D = 128
    the serial build adds dQ a tile late (dq_late: 5 query tiles of 64 rows, both dSᵀ buffers)."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    if not _on_hopper():
        pytest.skip("phase 12 runs on Hopper (sm_90) alone")
    from flashcore_numba import attention
    from flashcore_numba.runtime import torch_ops

    q, k, v = (torch.randn(2, 4, 300, head_dim, device="cuda", dtype=torch.float16) for _ in range(3))
    do = torch.randn_like(q)
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    runs = [torch_ops.attention_backward(q, k, v, out, lse, do, None, True, head_dim ** -0.5, det, which)
            for det, which in ((True, phase), (True, phase), (False, phase), (False, "11"))]
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    for other in runs[2:]:
        assert all((a.float() - b.float()).abs().max().item() < 1e-2 for a, b in zip(runs[0], other))


@pytest.mark.gpu
@pytest.mark.parametrize("D, dtype", [(64, "float16"), (128, "bfloat16"), (96, "float16")])
@pytest.mark.parametrize("bulk_dq, overlap, tied", [(True, False, False), (False, True, False), (True, True, False),
                                                    (False, False, False)],
                         ids=["bulk_dq", "overlap", "bulk_dq+overlap", "red"])
def test_phase12_builds_on_gpu(D, dtype, bulk_dq, overlap, tied):
    """The builds "bulk dQ", "overlap" and "red" (the accumulators copied, not tied: the default
    build's before "tied") on an H100: several key blocks and query tiles, causal with tails, GQA
    2, against the float64 gradients."""
    if not _on_hopper():
        pytest.skip("phase 12 runs on Hopper (sm_90) alone")
    q, k, v = (round_to(x, dtype) for x in random_qkv((2, 4, 517, D), 517, heads_kv=2, dtype=np.float32))
    do = round_to(np.random.default_rng().standard_normal(q.shape), dtype)
    o, lse = reference_attention(q, k, v, causal=True, scale=0.3), reference_lse(q, k, causal=True, scale=0.3)
    got = run_wgmma_backward(q, k, v, o, do, lse, dtype, causal=True, scale=0.3, bulk_dq=bulk_dq, overlap=overlap,
                             tied=tied)
    gradients_close(got, *both_references(q, k, v, do, dtype, causal=True, scale=0.3))


def test_phase_12s_measured_effect_comes_from_its_rows_of_the_backward_records(tmp_path):
    """`flashcore report` writes phase 12's "Measured effect" block from the rows 12 and
    12-deterministic of the backward records, each beside SDPA flash and phase 11 of the same run; a
    record without them (every record so far) leaves it "not measured yet"."""
    from flashcore_numba.measure import backward, bench, records, report

    problem = bench.Problem.from_shape((2, 2, 256, 64), causal=True)
    flops = int(backward.BACKWARD_FLOPS * problem.flops)

    def record(names):
        rows = []
        for name, ms in names:
            r = records.Result(name, "peer" if name.startswith("sdpa") else "phase", name, correct=True,
                               message="ok", max_err=1e-4, allowed_err=1e-3)
            bench.set_timing(r, [ms] * 3, flops, None)
            rows.append(r)
        rec = records.build_record(problem=problem, results=rows, provenance={"gpu_name": "Test GPU",
                                   "git_commit": None}, timing=bench.Timing(), ceiling=None,
                                   oracle={"reference": "t", "yardstick": "t"}, command=["flashcore"], seed=1)
        rec["flops"], rec["flops_rule"] = flops, backward.FLOPS_RULE
        rec["config"]["pass"] = "backward"
        return rec

    old = records.write_record(record([("11", 2.0), ("sdpa_flash", 1.0)]), tmp_path / "old" / "r.json")
    assert report.backward_measured_lines(records.load_records(old.parent), "12") == ["    not measured yet"]
    new = records.write_record(record([("11", 2.0), ("12", 1.0), ("12-deterministic", 1.6), ("sdpa_flash", 1.0)]),
                               tmp_path / "new" / "r.json")
    block = " ".join(line.strip() for line in report.backward_measured_lines(records.load_records(new.parent), "12"))
    assert "12 " in block and "(1.00x SDPA flash, 2.00x phase 11)" in block, block
    # no 11-deterministic in that run: beside SDPA flash alone
    assert "12-deterministic 0.05 (0.62x SDPA flash)" in block and "r.json" in block, block
    assert "12-step not timed (r.json)" in block, block  # a run whose training step was not timed says so
    step = records.write_record(record([("11", 2.0), ("12", 1.0), ("sdpa_flash", 1.0), ("12-step", 3.0), ("sdpa_flash-step", 1.5)]),
                                tmp_path / "step" / "r.json")
    block = " ".join(line.strip() for line in report.backward_measured_lines(records.load_records(step.parent), "12"))
    assert "12-step 0.03 (0.50x SDPA flash)" in block, block  # beside SDPA flash's step
    block = " ".join(line.strip() for line in report.backward_measured_lines(records.load_records(step.parent), "11"))
    assert "11-step not timed (autograd ran 12-step)" in block, block
    # phase 13's rows beside phase 12's, the phase it changes
    ws = records.write_record(record([("12", 1.0), ("13", 0.8), ("13-deterministic", 1.0), ("sdpa_flash", 1.0)]),
                              tmp_path / "ws" / "r.json")
    block = " ".join(line.strip() for line in report.backward_measured_lines(records.load_records(ws.parent), "13"))
    assert "(1.25x SDPA flash, 1.25x phase 12)" in block and "13-deterministic" in block, block


# ---------------------------------------------------------------------------------------------
# Phase 13 (in progress): phase 12's kv_kernel warp-specialized, a TMA producer feeding it
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("D, S, S_k, heads, dtype, bulk_dq", [
    pytest.param(64, 150, 140, (2, 1), "float16", True, id="D=64 bulk dQ, 2 query tiles, MQA"),
    pytest.param(64, 150, 140, (4, 2), "float16", False, id="D=64, 2 query tiles", marks=pytest.mark.slow),
    pytest.param(96, 70, 75, (4, 2), "bfloat16", False, id="D=96 rounded up, bf16", marks=pytest.mark.slow),
    pytest.param(128, 130, 200, (4, 2), "float16", False, id="D=128, 3 query tiles, 2 key blocks",
                 marks=pytest.mark.slow),
    pytest.param(128, 200, 140, (4, 2), "float16", True, id="D=128 bulk dQ, 4 query tiles", marks=pytest.mark.slow),
])
def test_phase13_matches_the_reference_gradients(D, S, S_k, heads, dtype, bulk_dq):
    """Phase 13's kv_kernel: the producer's TMA loads of K, V and each query tile's Q and dO through
    the two-stage ring (more query tiles than stages, so that a stage is refilled after its empty
    barrier), two query heads a K/V head (the group's heads in turn), causal with tails of both
    lengths (the default run's case on one K/V head: half the blocks); with bulk_dq the
    consumers' pieces of dQ through two slots each to the writer's bulk reductions (more pieces
    than slots); its serial build with deterministic=True, one block over every key block (parts=1:
    the producer reloads K and V after kv_empty, the ring's count runs on)."""
    from flashcore_numba.phases import p13_backward_ws as p13

    bw = p13.build(D, dtype, bulk_dq=bulk_dq)
    assert bw.cache_id("13-kv")[0] == "13-kv" and bw.kv["WS_THREADS"] == 384
    check_phase13((1, heads[0], S, D), S_k, dtype, bulk_dq, heads_kv=heads[1])


@pytest.mark.gpu
@pytest.mark.parametrize("bulk_dq, tied", [(False, False), (True, False), (False, True)], ids=["red", "bulk dQ", "tied"])
@pytest.mark.parametrize("D, dtype", [(64, "float16"), (128, "bfloat16"), (96, "float16"), (40, "float16")])
def test_phase13_on_gpu(D, dtype, bulk_dq, tied):
    """Phase 13 on an H100: its producer's TMA loads (rows past the sequences and columns past D as
    zeros), the ring over several query tiles, several key blocks, causal with tails, GQA 2, and
    its serial build, against the float64 gradients."""
    if not _on_hopper():
        pytest.skip("phase 13 runs on Hopper (sm_90) alone")
    check_phase13((2, 4, 517, D), 490, dtype, bulk_dq, tied=tied)


def check_phase13(shape, seq_k, dtype, bulk_dq, heads_kv=2, tied=False):
    """Phase 13's gradients, with atomics and deterministic, causal, GQA, scale 0.3, against the
    float64 references (fresh inputs; run_on_host starts dQ, dK and dV as NaN)."""
    from flashcore_numba.phases import p13_backward_ws as p13

    q, k, v = (round_to(x, dtype) for x in random_qkv(shape, seq_k, heads_kv=heads_kv, dtype=np.float32))
    do = round_to(np.random.default_rng().standard_normal(q.shape), dtype)
    o, lse = reference_attention(q, k, v, causal=True, scale=0.3), reference_lse(q, k, causal=True, scale=0.3)
    want = both_references(q, k, v, do, dtype, causal=True, scale=0.3)
    for deterministic in (False, True):
        got = run_backward(q, k, v, o, do, lse, dtype, causal=True, scale=0.3, deterministic=deterministic,
                           backward=p13.backward, bulk_dq=bulk_dq, tied=tied, parts=1 if deterministic else None)
        gradients_close(got, *want)
