"""Head dims other than 64 and 128: phase 07 builds any multiple of 8 up to 256 (its tiles laid out
for D rounded up to a multiple of 32, the columns past D zero), phase 09 any up to 128 (on its 64- or
128-column tiles, TMA's zero fill past D), and attention(), attention_varlen and `flashcore compile`
send such a head dim to the newest of them.

In the simulator (GPU: the `gpu` tests). Every case has tails (S_q and S_k not multiples
of the tile), grouped-query heads and a poisoned output (and, further down, v with a head dim of its
own, as MLA has): a store past a row's D columns lands in the
next row, which the reference then catches (and past the last one, outside the array). The default
run takes head dims of each kind: below 32, rounded up to 64, 96 (twelve chunks a row, not a power
of two), past 128 (one m-tile per warp) and 256; every multiple of 8 from 8 to 256 is the slow sweep.
"""

import numpy as np
import pytest

from flashcore_numba import attention, check_close, lowp_attention, reference_attention
from flashcore_numba.phases import PHASES, head_dims_text, supports_head_dim, supports_value_dim
from flashcore_numba.phases import p07_mma_sync as p07
from flashcore_numba.reference import random_qkv

pytestmark = pytest.mark.beside  # long simulator runs: a child pytest runs them on the second core (conftest.py)

DEFAULT = (24, 40, 96, 160, 256)
SWEEP = [pytest.param(D, marks=pytest.mark.slow) for D in range(8, 257, 8) if D not in DEFAULT]


def run_poisoned(q, k, v, causal, phase="07"):
    """`phase` (07: at v's head dim too, where it has one of its own) at q's head dim, into an output
    of NaN; what it wrote."""
    from numba import cuda

    from flashcore_numba.phases import build
    from flashcore_numba.phases.common import LOG2E

    D, Dv = q.shape[-1], v.shape[-1]
    out = cuda.to_device(np.full((*q.shape[:3], Dv), np.nan, dtype=np.float16))
    config = build(PHASES[phase], D, value_dim=None if Dv == D else Dv)
    config.launch(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), out, causal, LOG2E / np.sqrt(D))
    return out.copy_to_host()


def check_head_dim(D, causal, seed=None, phase="07"):
    # 20 query rows (fewer than a block), 40 keys (a tile and a tail); two query heads on one k/v head
    q, k, v = random_qkv((1, 2, 20, D), 40, heads_kv=1, seed=seed)
    out = run_poisoned(q, k, v, causal, phase)
    k2, v2 = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    verdict = check_close(out, reference_attention(q, k2, v2, causal=causal), lowp_attention(q, k2, v2, causal=causal))
    assert verdict.ok, f"phase {phase} D={D} causal={causal}: {verdict.message}"


@pytest.mark.parametrize("D", [*DEFAULT, *SWEEP])
def test_phase07_runs_every_head_dim(D):
    check_head_dim(D, causal=D % 16 == 8)  # causal and not, alternately over the sweep


@pytest.mark.parametrize("D", [96, pytest.param(256, marks=pytest.mark.slow)])
def test_phase07_every_head_dim_causal_and_not(D):
    check_head_dim(D, causal=D % 16 != 8)  # the other setting of the sweep's


@pytest.mark.parametrize("D", [24, 96, 192, 232] + [pytest.param(D, marks=pytest.mark.slow) for D in range(8, 257, 8)
                                                    if D not in (24, 64, 96, 128, 192, 232)])
def test_phase09_runs_every_head_dim(D):
    """Phase 09 on its 64-, 128-, 192- or 256-column tiles, TMA's zero fill past D: causal and not."""
    for causal in (False, True):
        check_head_dim(D, causal, phase="09")


def test_the_layout_of_a_rounded_up_head_dim():
    """D = 40: the tiles are 64 columns wide (D = 64's shapes), 5 of a row's 8 chunks from global memory;
    D = 96: twelve chunks a row, copied by 16 lanes a row (4 idle); D = 160: one m-tile per warp."""
    L = p07.layout(40, **p07.TILES[64])
    assert (L["D_TILE"], L["CHUNKS"], L["GLOBAL_CHUNKS"], L["CHUNK_LANES"], L["NO"]) == (64, 8, 5, 8, 8)
    L = p07.layout(96, **p07.TILES[128])
    assert (L["D_TILE"], L["CHUNKS"], L["GLOBAL_CHUNKS"], L["CHUNK_LANES"], L["ROWS_PER_PASS"]) == (96, 12, 12, 16, 8)
    L = p07.layout(160, 128, 48, 8)  # (the GPU's tiles: the simulator's are one warp)
    assert (L["M_TILES"], L["N_THREADS"], L["KQ"], L["NO"]) == (1, 256, 10, 20)
    assert L["SMEM_BYTES"] <= 227 * 1024


def test_head_dims_a_phase_takes():
    assert [D for D in range(1, 300) if p07.runs_head_dim(D)] == list(range(8, 257, 8))
    assert [D for D in range(1, 300) if supports_head_dim(PHASES["09"], D)] == list(range(8, 257, 8))
    assert not supports_head_dim(PHASES["07"], 100) and not supports_head_dim(PHASES["07"], 264)
    assert head_dims_text(PHASES["09"]) == "any multiple of 8 from 8 to 256"
    assert [D for D in range(1, 300) if supports_head_dim(PHASES["10"], D)] == list(range(8, 257, 8))
    assert head_dims_text(PHASES["10"]) == "any multiple of 8 from 8 to 256" and "multiple of 8" in head_dims_text(PHASES["07"])
    with pytest.raises(ValueError, match="head dim: phase 07 builds any multiple of 8 from 8 to 256, not 100"):
        p07.build(100)


def test_best_runs_the_newest_phase_built_for_the_head_dim():
    from flashcore_numba import api

    assert api.best_for_this_gpu(64).ID == api.best_for_this_gpu(96).ID == api.best_for_this_gpu(256).ID \
        == api.best_for_this_gpu().ID != "07"
    assert api.best_for_this_gpu(100).ID == api.best_for_this_gpu().ID  # none takes it: the validation says why
    # a decode shape runs phase 10 at every head dim it takes
    for D in (64, 96, 256):
        assert api.best_for_shape(PHASES["09"], D, False, 1000, rows_per_kv_head=1).ID == "10"
        assert api.best_for_shape(PHASES["07"], D, False, 1000, rows_per_kv_head=1).ID == "10"
    assert api.best_for_shape(PHASES["09"], 96, False, 1000, rows_per_kv_head=64).ID == "09"


def test_attention_runs_a_head_dim_of_96_on_best():
    q, k, v = random_qkv((1, 2, 20, 96), 33, heads_kv=1)
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    k2, v2 = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    verdict = check_close(out, reference_attention(q, k2, v2, causal=True), lowp_attention(q, k2, v2, causal=True))
    assert verdict.ok, verdict.message
    assert lse.shape == (1, 2, 20) and np.isfinite(lse).all()


@pytest.mark.parametrize("D, phase, message", [
    (100, "best", r"q: head dim 100 is not supported by phase \d\d \(it takes .*\); phase 07 takes any multiple of 8"),
    (100, "07", r"q: head dim 100 is not supported by phase 07 \(it takes any multiple of 8 from 8 to 256\)$"),
    (264, "09", r"q: head dim 264 is not supported by phase 09 \(it takes any multiple of 8 from 8 to 256\); "
                r"phase 07 takes any multiple"),
    (100, "10", r"q: head dim 100 is not supported by phase 10 \(it takes any multiple of 8 from 8 to 256\); "
                r"phase 07 takes any multiple"),
    (264, "07", r"q: head dim 264 is not supported by phase 07"),
])
def test_a_head_dim_no_phase_takes_is_refused_by_name(D, phase, message):
    q = np.zeros((1, 1, 4, D), np.float16)
    with pytest.raises(ValueError, match=message):
        attention(q, q, q, phase=phase)


def test_the_backward_refuses_other_head_dims_before_the_forward():
    """attention()'s autograd takes what phase 11 builds, any multiple of 8 up to 256 (phases 13 and
    12 on Hopper up to 128); past it (or off the multiples of 8) a call that needs gradients is refused
    before its forward."""
    from flashcore_numba import api

    for D in (264, 100):
        with pytest.raises(ValueError, match=f"q: requires grad, but the backward takes head dims any multiple of 8 "
                                             f"from 8 to 256, not {D}$"):
            api.require_backward("best", None, D)
    for D in (8, 40, 96, 128, 136, 256):
        api.require_backward("best", None, D)


def test_compile_lists_each_phase_at_the_head_dims_it_takes():
    from flashcore_numba.runtime import precompile

    items = precompile.kernels_to_compile(["07", "09", "07-varlen", "10", "10-kvcache", "11", "12"], [96, 128, 160],
                                          ["float16"])
    assert ("07", 96, "float16") in items and ("07-varlen", 96, "float16") in items
    assert ("09", 96, "float16") in items and ("09", 160, "float16") in items
    assert ("10", 128, "float16") in items and ("10", 160, "float16") in items and ("10-kvcache", 96, "float16") in items
    # the backward's: phase 11 up to 256, phase 12 (wgmma) up to 128
    assert ("11", 96, "float16") in items and ("11", 160, "float16") in items
    assert ("12", 128, "float16") in items and ("12", 160, "float16") not in items


def test_compile_takes_value_head_dims_where_a_phase_takes_the_pair():
    """`flashcore compile --head-dims 192 --value-dims 128` (MLA): the forward kernels of phases 07
    and 09, dense and packed, at 192 / 128 beside the 192 ones, keyed as their launches key them;
    none for a kernel that takes one head dim (10, the backward), nor 09 where its tiles do not take
    the pair (128 / 64)."""
    from flashcore_numba.phases import build, build_varlen
    from flashcore_numba.runtime import precompile

    ids = ["07", "09", "07-varlen", "09-varlen", "10", "11"]
    items = precompile.kernels_to_compile(ids, [192, 128], ["float16"], [128, 64])
    for kid in ("07", "09", "07-varlen", "09-varlen"):
        assert (kid, 192, "float16", 128) in items and (kid, 192, "float16") in items, kid
    assert ("07", 128, "float16", 64) in items and ("09", 128, "float16", 64) not in items
    assert not [i for i in items if len(i) == 4 and i[0] in ("10", "11")]
    assert not [i for i in items if len(i) == 4 and i[1] == i[3]]  # (128 beside 128 is no pair)
    assert build_varlen("09", 192, "float16", 128).cache_key == ("09-varlen", 192, "float16", 128)
    assert build(PHASES["07"], 192, "float16", value_dim=128).cache_key == ("07", 192, "float16", 128)
    assert [identity for _, _, identity in precompile.kernels_of("07-varlen", 192, "float16", (9, 0), 128)] == [
        ("07-varlen", 192, "float16", 128)]


# ---------------------------------------------------------------------------------------------
# On the GPU (FLASHCORE_GPU=1 python3 -m pytest -m gpu): the real tiles, longer sequences
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("phase, D", [(phase, D) for phase in ("07", "09") for D in range(8, 257, 8)])
def test_every_head_dim_on_gpu(phase, D):
    for causal, (S_q, S_k) in ((False, (300, 450)), (True, (517, 517))):
        q, k, v = random_qkv((2, 4, S_q, D), S_k, heads_kv=2)
        out = run_poisoned(q, k, v, causal, phase)
        k2, v2 = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
        verdict = check_close(out, reference_attention(q, k2, v2, causal=causal),
                              lowp_attention(q, k2, v2, causal=causal))
        assert verdict.ok, f"phase {phase} D={D} causal={causal}: {verdict.message}"


@pytest.mark.gpu
@pytest.mark.parametrize("D", range(8, 257, 8))
def test_phase10_every_head_dim_on_gpu(D):
    """Phase 10 (decode) at every head dim on its real tiles (64, 128 or 256 columns), both builds:
    one query row of 8 heads on 2 K/V heads against 3000 keys (the split rule cuts them across
    blocks and warps, and the merge adds them up), then 5 drafted rows (20 packed rows a K/V head:
    two row tiles, the second part empty), causal and not, on poisoned output."""
    from numba import cuda

    from flashcore_numba.phases import KERNELS, build
    from flashcore_numba.phases.common import LOG2E

    for variant in ("10", "10-batch"):
        config = build(KERNELS[variant], D)  # named: `flashcore compile` can put it in the kernel cache
        for causal, S_q in ((False, 1), (True, 5)):
            q, k, v = random_qkv((2, 8, S_q, D), 3000, heads_kv=2)
            out = cuda.to_device(np.full(q.shape, np.nan, np.float16))
            config.launch(*(cuda.to_device(x) for x in (q, k, v)), out, causal, LOG2E / np.sqrt(D))
            k4, v4 = np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1)
            verdict = check_close(out.copy_to_host(), reference_attention(q, k4, v4, causal=causal),
                                  lowp_attention(q, k4, v4, causal=causal))
            assert verdict.ok, f"{variant} D={D} causal={causal}: {verdict.message}"


# ---------------------------------------------------------------------------------------------
# The backward (phase 11) at head dims up to 128: its tiles 64 or 128 columns wide
# ---------------------------------------------------------------------------------------------
def check_backward_head_dim(D, shape, seq_k, heads_kv, causal, deterministic, dtype="float16", phase="11"):
    from test_backward import both_references, gradients_close, run_backward

    from flashcore_numba.phases import p11_backward, p12_backward_wgmma

    from flashcore_numba.reference import reference_lse, round_to

    q, k, v = (round_to(x, dtype) for x in random_qkv((*shape, D), seq_k, heads_kv=heads_kv, dtype=np.float32))
    do = round_to(np.random.default_rng().standard_normal(q.shape), dtype)
    o = reference_attention(q, k, v, causal=causal, scale=0.3)
    lse = reference_lse(q, k, causal=causal, scale=0.3)
    module = {"11": p11_backward, "12": p12_backward_wgmma}[phase]
    got = run_backward(q, k, v, o, do, lse, dtype, causal=causal, scale=0.3, deterministic=deterministic,
                       backward=module.backward)
    gradients_close(got, *both_references(q, k, v, do, dtype, causal=causal, scale=0.3))


@pytest.mark.parametrize("D, causal, deterministic", [
    pytest.param(40, True, False, id="D=40 causal"),
    pytest.param(96, False, True, id="D=96 deterministic", marks=pytest.mark.slow),
    pytest.param(8, True, True, id="D=8", marks=pytest.mark.slow),
    pytest.param(120, True, False, id="D=120", marks=pytest.mark.slow),
    pytest.param(200, True, False, id="D=200, two column parts", marks=pytest.mark.slow),
    pytest.param(256, False, True, id="D=256 deterministic", marks=pytest.mark.slow),
])
def test_phase11_backward_at_other_head_dims(D, causal, deterministic):
    """Phase 11's kernels at a head dim rounded up to their 64-, 128- or 256-column tiles
    (tile_head_dim): Q, K, V and dO copied with zeros past D, Δ summed over D's columns alone, dQ,
    dK and dV stored in D's columns only (the outputs start as NaN: a column left unwritten fails,
    one written past D lands in the next row), GQA 2, tails of both lengths, against the float64
    gradients. Past 128 two blocks share each key block's gradients by columns (column_parts), the
    second's columns ending in the tail past D at 200."""
    from flashcore_numba.phases import p11_backward as p11

    assert p11.tile_head_dim(D) == (64 if D <= 64 else 128 if D <= 128 else 256) and p11.runs_head_dim(D)
    check_backward_head_dim(D, (1, 4, 19), 23, 2, causal, deterministic)


def test_the_head_dims_the_backward_builds():
    from flashcore_numba.phases import p11_backward as p11

    assert [D for D in range(1, 300) if p11.runs_head_dim(D)] == list(range(8, 257, 8))
    L = p11.layout(96, 8, 64, 2)
    assert (L["D_TILE"], L["CHUNKS"], L["GLOBAL_CHUNKS"], L["ND"], L["KD"]) == (128, 16, 12, 16, 8)
    assert (L["COLUMN_PARTS"], L["PART_COLS"]) == (1, 128)
    # past 128: 256-column rows, the gradients in two parts of 128 columns (a warp's dK and dV as at 128)
    L = p11.layout(200, *p11.kv_shape(200, (9, 0)))
    assert (L["D_TILE"], L["GLOBAL_CHUNKS"], L["COLUMN_PARTS"], L["PART_COLS"], L["ND"], L["KD"]) == \
        (256, 25, 2, 128, 16, 16)
    assert (L["WARPS"], L["STREAM_ROWS"], L["DS_BUFFERS"]) == (4, 64, 2)
    assert p11.kv_grid(L, 3, 4, 2) == (3, 8, 2) and p11.kv_grid(p11.layout(128, 8, 64, 2), 3, 4, 2) == (3, 4, 2)
    from flashcore_numba.phases import p12_backward_wgmma as p12  # on wgmma: up to 128

    assert [D for D in range(1, 300) if p12.runs_head_dim(D)] == list(range(8, 129, 8))
    assert p11.HEAD_DIMS == (64, 128)  # the course's (its lesson and exercise)


@pytest.mark.parametrize("D, causal, deterministic", [
    pytest.param(40, True, True, id="D=40 causal deterministic"),
    pytest.param(96, False, False, id="D=96"),
    pytest.param(120, True, False, id="D=120", marks=pytest.mark.slow),
])
def test_phase12_backward_at_other_head_dims(D, causal, deterministic):
    """Phase 12's (wgmma) at a head dim rounded up to its 64- or 128-column tiles: the copies into
    the swizzled atoms fill the columns past D with zeros, and dQ's pieces add only D's columns."""
    from flashcore_numba.phases import p12_backward_wgmma as p12

    L = p12.layout(D, p12.WARPGROUPS, p12.query_rows(D))
    assert L["D_TILE"] == (64 if D <= 64 else 128) and L["GLOBAL_CHUNKS"] == D // 8
    check_backward_head_dim(D, (1, 4, 19), 23, 2, causal, deterministic, phase="12")


@pytest.mark.gpu
@pytest.mark.parametrize("D, phase", [(D, "11") for D in range(8, 257, 8)] + [(D, "12") for D in range(8, 129, 8)])
def test_backward_every_head_dim_on_gpu(D, phase):
    """The backward (phase 11 up to 256, and phase 12 on Hopper up to 128) at every head dim it
    builds, on its real blocks: several key blocks and query tiles, causal with tails and not, GQA
    2, atomics and deterministic, fp16 and bf16."""
    from numba import cuda

    if phase == "12" and cuda.get_current_device().compute_capability != (9, 0):
        pytest.skip("phase 12 runs on Hopper (compute capability 9.0) only")
    check_backward_head_dim(D, (2, 4, 300), 450, 2, False, False, phase=phase)
    check_backward_head_dim(D, (1, 4, 517), 517, 2, True, True, dtype="bfloat16", phase=phase)


# ---------------------------------------------------------------------------------------------
# A value head dim of its own (MLA: 192 for q and k, 128 for v and the output)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("D, Dv, causal", [(192, 128, True), (64, 256, False),
                                           pytest.param(96, 40, True, marks=pytest.mark.slow)])
def test_phase07_takes_a_value_head_dim_of_its_own(D, Dv, causal):
    """q and k of head dim D, v of Dv: the output is (B, H, S_q, Dv). (64, 256): a narrow K beside a
    wide V; (96, 40): a V rounded up, its copy given more lanes than its chunks."""
    rng = np.random.default_rng()
    q = rng.standard_normal((1, 2, 20, D)).astype(np.float16)
    k = rng.standard_normal((1, 1, 40, D)).astype(np.float16)
    v = rng.standard_normal((1, 1, 40, Dv)).astype(np.float16)
    out = run_poisoned(q, k, v, causal)
    k2, v2 = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    verdict = check_close(out, reference_attention(q, k2, v2, causal=causal), lowp_attention(q, k2, v2, causal=causal))
    assert out.shape == (1, 2, 20, Dv) and verdict.ok, f"D={D} Dv={Dv}: {verdict.message}"


# the long run: 31 s of the default run's critical path (the `beside` child); the default run keeps
# attention() at 192 / 128 on phase 09, one tile (test_attention_with_a_value_head_dim_of_its_own_...)
@pytest.mark.slow
@pytest.mark.parametrize("D, Dv", [(192, 128), (256, 136)])
def test_phase09_takes_a_value_head_dim_of_its_own(D, Dv):
    """Phase 09 with V narrower than K (MLA's 128 beside 192): V's tile has fewer atoms in a stage,
    P·V and the epilogue are V's width; several tiles of keys, causal and not, two heads on one."""
    rng = np.random.default_rng()
    for causal in (False, True):
        q, k, _ = random_qkv((1, 2, 150, D), 270, heads_kv=1)
        v = rng.standard_normal((1, 1, 270, Dv)).astype(np.float16)
        out = run_poisoned(q, k, v, causal, "09")
        k2, v2 = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
        verdict = check_close(out, reference_attention(q, k2, v2, causal=causal), lowp_attention(q, k2, v2, causal=causal))
        assert out.shape == (1, 2, 150, Dv) and verdict.ok, f"phase 09 D={D} Dv={Dv} causal={causal}: {verdict.message}"


def test_the_grader_sizes_phase_09s_cases_by_its_tiles():
    """The key tile is per head dim now (KEYS_PER_TILE): the grader reads it from `tiles`, so that its
    cases still span two key tiles (with 16 keys, as for an untiled phase, the stub passed large_logits)."""
    from flashcore_numba.course import grade
    from flashcore_numba.phases import p09_warp_specialized as p09

    assert grade.tile_sizes(p09, 64) == (p09.build(64).block_m, 128)
    assert p09.tiles(256)["block_n"] == 64 and p09.tiles(96) == p09.tiles(128)


def test_the_value_head_dims_phase_09_takes():
    from flashcore_numba.phases import p09_warp_specialized as p09

    assert p09.runs_value_dim(192, 128) and p09.runs_value_dim(256, 136) and p09.runs_value_dim(96, 96)
    assert not p09.runs_value_dim(128, 64) and not p09.runs_value_dim(192, 64) and not p09.runs_value_dim(192, 200)
    assert supports_value_dim(PHASES["09"], 192, 128) and not supports_value_dim(PHASES["09"], 128, 64)
    with pytest.raises(ValueError, match="value head dim: phase 09 takes v's head dim of its own where"):
        p09.build(128, value_dim=64)
    L = p09.layout(192, 128)
    assert (L["ATOMS"], L["V_ATOMS"], L["NO"], L["N_OUT"]) == (3, 2, 16, 16)
    assert L["STAGE_BYTES"] == L["BLOCK_N"] * (192 + 128) * 2


@pytest.mark.gpu
@pytest.mark.parametrize("D, Dv", [(192, 128), (256, 136)])
def test_phase09_value_head_dim_on_gpu(D, Dv):
    for causal, (S_q, S_k) in ((False, (300, 450)), (True, (517, 517))):
        q, k, _ = random_qkv((2, 4, S_q, D), S_k, heads_kv=2)
        v = np.random.default_rng().standard_normal((2, 2, S_k, Dv)).astype(np.float16)
        out = run_poisoned(q, k, v, causal, "09")
        k2, v2 = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
        verdict = check_close(out, reference_attention(q, k2, v2, causal=causal), lowp_attention(q, k2, v2, causal=causal))
        assert verdict.ok, f"phase 09 D={D} Dv={Dv} causal={causal}: {verdict.message}"


def test_attention_with_a_value_head_dim_of_its_own_runs_phase_09_where_its_tiles_take_it():
    from flashcore_numba import api

    q, k, _ = random_qkv((1, 2, 20, 192), 27, heads_kv=1)
    v = np.random.default_rng().standard_normal((1, 1, 27, 128)).astype(np.float16)
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    k2, v2 = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    verdict = check_close(out, reference_attention(q, k2, v2, causal=True), lowp_attention(q, k2, v2, causal=True))
    assert out.shape == (1, 2, 20, 128) and verdict.ok, verdict.message
    assert api.best_for_this_gpu(192, 128).ID == "09" and api.best_for_this_gpu(128, 128).ID == "09"
    assert api.best_for_this_gpu(128, 64).ID == "07" and api.best_for_this_gpu(64, 256).ID == "07"


@pytest.mark.parametrize("Dv, phase, message", [
    (64, "09", r"v: head dim 64 differs from q's 128 .*; phase 09 does not take v's head dim 64 beside q's 128 "
               r"\(phase 07 takes v's of its own: any multiple of 8"),
    (64, "08", r"v: head dim 64 differs from q's 128 .*; phase 08 takes one head dim for q, k and v"),
    (100, "07", r"v: head dim 100 is not supported by phase 07"),
    (100, "best", r"v: head dim 100 differs from q's 128"),
])
def test_a_value_head_dim_no_phase_takes_is_refused_by_name(Dv, phase, message):
    q = np.zeros((1, 1, 4, 128), np.float16)
    with pytest.raises(ValueError, match=message):
        attention(q, q, np.zeros((1, 1, 4, Dv), np.float16), phase=phase)


def test_the_backward_takes_a_value_head_dim_of_its_own_and_varlen_names_what_it_takes():
    from flashcore_numba import api
    from flashcore_numba.inference import _varlen_phase, attention_varlen

    api.require_backward("best", None, 192, 128)  # MLA: the backward pads to the wider (test below)
    with pytest.raises(ValueError, match="v: requires grad, but the backward takes head dims .*, not 100"):
        api.require_backward("best", None, 128, 100)
    q = np.zeros((8, 1, 192), np.float16)
    cu = np.array([0, 8], np.int32)
    with pytest.raises(ValueError, match="v: packed rows and heads"):
        attention_varlen(q, q, np.zeros((7, 1, 128), np.float16), cu, cu, 8, 8)
    with pytest.raises(ValueError, match="v: head dim 64 differs from q's 128; phase 09 does not take"):
        _varlen_phase("09", 128, 64)
    with pytest.raises(ValueError, match="v: head dim 100 is not supported by phase 07"):
        _varlen_phase("07", 128, 100)
    assert _varlen_phase("07", 192, 128) == "07" and _varlen_phase("09", 192, 128) == "09"
    assert _varlen_phase("best", 128, 64) == "07"  # phase 09 does not take that pair


@pytest.mark.parametrize("D, Dv", [(48, 32), (16, 40)], ids=["v narrower (MLA)", "v wider"])
def test_the_backward_of_a_value_head_dim_of_its_own_pads_to_the_wider(monkeypatch, D, Dv):
    """torch_ops.attention_backward with v of its own head dim runs the backward of one head dim, the
    wider, on operands padded with zero columns, and cuts the gradients back: with a stand-in plan
    that computes the float64 reference's gradients of what it is given, the result is the
    reference's gradients of the problem itself (GQA 2, causal, S_q != S_k). CPU tensors, no GPU."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")
    from flashcore_numba import runtime
    from flashcore_numba.reference import reference_attention, reference_gradients, reference_lse
    from flashcore_numba.runtime import torch_ops
    from flashcore_numba.runtime.plan import Plans

    widths = []

    class ReferencePlan:
        def __init__(self, head_dim, *rest):
            widths.append(head_dim)
            self.parts = 1

        def __call__(self, q, k, v, out, dout, lse, dq, dk, dv, delta, stream, dq_sums=None, dlse=None):
            assert q.shape[-1] == k.shape[-1] == v.shape[-1] == out.shape[-1] == dout.shape[-1] == max(D, Dv)
            got = reference_gradients(*(x.double().numpy() for x in (q, k, v, dout)), causal=True, scale=0.3)
            for buffer, g in zip((dq, dk, dv), got):
                buffer.copy_(torch.from_numpy(g))

    monkeypatch.setattr(runtime, "BackwardPlan", ReferencePlan)
    monkeypatch.setattr(torch_ops, "current_stream", lambda device: 0)
    monkeypatch.setattr(torch_ops, "_BACKWARD_PLANS", Plans())
    monkeypatch.setattr(torch_ops, "_AUTOGRAD_BACKWARD", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    q, k, v = random_qkv((1, 4, 7, D), 9, heads_kv=2, seed=5, dtype=np.float32, value_dim=Dv)
    do = np.random.default_rng(5).standard_normal((1, 4, 7, Dv))
    out = reference_attention(q, k, v, causal=True, scale=0.3)
    lse = reference_lse(q, k, causal=True, scale=0.3)
    t = [torch.from_numpy(np.asarray(x, np.float32)) for x in (q, k, v, out, lse, do)]
    got = torch_ops.attention_backward(t[0], t[1], t[2], t[3], t[4], t[5], None, True, 0.3, False)
    assert widths == [max(D, Dv)] and [tuple(g.shape) for g in got] == [q.shape, k.shape, v.shape]
    for g, r in zip(got, reference_gradients(q, k, v, do, causal=True, scale=0.3)):
        np.testing.assert_allclose(g.double().numpy(), r, atol=1e-5)


def test_a_value_head_dim_has_its_own_cache_identity():
    from flashcore_numba.phases import build

    assert build(PHASES["07"], 192, "float16", value_dim=128).cache_key == ("07", 192, "float16", 128)
    assert build(PHASES["07"], 192, "float16", value_dim=192).cache_key == ("07", 192, "float16")
    with pytest.raises(ValueError, match="value head dim: phase 09 does not take v's head dim 64 beside q's 128"):
        build(PHASES["09"], 128, "float16", value_dim=64)


@pytest.mark.gpu
@pytest.mark.parametrize("D, Dv", [(96, 96), (256, 256), (40, 40), (192, 128), (256, 136), (64, 256)])
def test_attention_on_torch_at_other_head_dims_on_gpu(D, Dv):
    """attention() on CUDA tensors (the plan's driver launch): through "best" (phase 09 on Hopper,
    MLA's pairs included where its tiles take them; phase 07 elsewhere and for 64/256), the output of
    v's head dim, against the float64 reference; and the call again on the same plan."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")
    rng = np.random.default_rng()
    q = rng.standard_normal((2, 8, 300, D)).astype(np.float16)
    k = rng.standard_normal((2, 4, 333, D)).astype(np.float16)
    v = rng.standard_normal((2, 4, 333, Dv)).astype(np.float16)
    k2, v2 = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    for causal in (False, True):
        ref, lowp = reference_attention(q, k2, v2, causal=causal), lowp_attention(q, k2, v2, causal=causal)
        for _ in range(2):
            out = attention(*(torch.from_numpy(x).cuda() for x in (q, k, v)), causal=causal)
            assert tuple(out.shape) == (2, 8, 300, Dv)
            verdict = check_close(out.cpu().numpy(), ref, lowp)
            assert verdict.ok, f"D={D} Dv={Dv} causal={causal}: {verdict.message}"


@pytest.mark.parametrize("D", [pytest.param(96, marks=pytest.mark.slow), 200])
def test_phase07_bf16_at_other_head_dims(D):
    """bf16 (the same kernel with the bf16 mma and conversions), inputs rounded to bf16 first; the
    yardstick is the same attention rounded to bf16 (tests/test_phases.py's bf16 test)."""
    from test_phases import run_bf16

    from flashcore_numba.reference import round_to

    q, k, v = (round_to(x, "bfloat16") for x in random_qkv((1, 1, 20, D), 40, dtype=np.float32))
    out = run_bf16("07", q, k, v, True)
    verdict = check_close(out, reference_attention(q, k, v, causal=True),
                          lowp_attention(q, k, v, causal=True, dtype="bfloat16"))
    assert verdict.ok, f"phase 07 bf16 D={D}: {verdict.message}"


# ---------------------------------------------------------------------------------------------
# The benchmark of such a problem (`flashcore bench --shape 16,16,2048,192 --value-dim 128` on a GPU)
# ---------------------------------------------------------------------------------------------
def test_a_problem_with_a_value_head_dim_of_its_own():
    from flashcore_numba.measure import bench

    p = bench.Problem(2, 4, 128, 128, 192, D_v=128)
    assert p.tag == "b2h4s128d192v128_fp16" and "D=192 D_v=128" in p.describe() and p.as_dict()["D_v"] == 128
    assert p.flops == (bench.attention_flops(2, 4, 128, 128, 192, False) + bench.attention_flops(2, 4, 128, 128, 128,
                                                                                                   False)) // 2
    assert p.kv_bytes == 2 * 4 * 128 * (192 + 128) * 2
    same = bench.Problem(2, 4, 128, 128, 192, D_v=192)
    assert same.D_v is None and "D_v" not in same.as_dict() and same.tag == "b2h4s128d192_fp16"


@pytest.mark.skipif(not p07.simulator_enabled(), reason="uses the CUDA simulator")
def test_the_benchmark_runs_phase_07_at_a_value_head_dim_and_says_why_not_the_others():
    from test_harness import FakeTimedDevice

    from flashcore_numba.measure import bench, records

    problem = bench.Problem(1, 2, 16, 16, 64, causal=True, D_v=32)
    record = bench.run_benchmark(problem, phase_ids=["05", "07"], peer_names=[], timing=bench.Timing(1, 3),
                                 device=FakeTimedDevice())
    assert records.validate_record(record) == [] and record["config"]["D_v"] == 32
    p05, p07_result = record["results"]
    assert p05["available"] is False and "one head dim for q, k and v" in p05["reason"]
    assert p07_result["correct"] is True, p07_result["message"]


def test_the_report_shows_the_committed_records_of_other_head_dims():
    """docs/performance.md has a table per committed head-dim record, the MLA one too (only phase 07
    runs it: a one-phase record that is no ladder), phase 09 and cuDNN side by side where both ran."""
    from pathlib import Path

    from flashcore_numba.measure import records, report

    bench_dir = Path(__file__).resolve().parents[1] / "docs" / "bench"
    committed = [r for r in records.load_records(bench_dir) if "sweep" not in r]
    anchor, _ = report.ladder_records(committed)
    shown = {report._describe(pair[0]["config"]) for pair in report.other_ladders(committed, anchor) if pair[0]}
    assert {"B=16 H=16 S=2048 D=96 fp16", "B=16 H=16 S=2048 D=256 fp16", "B=16 H=16 S=2048 D=192 D_v=128 fp16"} <= shown


def test_the_custom_ops_fake_gives_the_output_v_s_head_dim():
    """Under torch.compile the op is traced on fake tensors: its output must have v's head dim (MLA)."""
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[torch]')")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flashcore_numba.runtime import torch_ops

    with FakeTensorMode():
        q, k = torch.empty(1, 2, 8, 192, dtype=torch.float16), torch.empty(1, 1, 8, 192, dtype=torch.float16)
        v = torch.empty(1, 1, 8, 128, dtype=torch.float16)
        out = torch_ops.custom_op(False)(q, k, v, True, None, "best")
        out_lse, lse = torch_ops.custom_op(True)(q, k, v, True, None, "best")
    assert tuple(out.shape) == tuple(out_lse.shape) == (1, 2, 8, 128) and tuple(lse.shape) == (1, 2, 8)
