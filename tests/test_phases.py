"""Every phase against the float64 reference, in the CUDA simulator (GPU: tests/test_gpu.py).

Shapes are tiny because the simulator runs one Python thread per CUDA thread (and the phases
build their kernels with small tiles there: 16 keys, 32 query rows). They still cover: S a
multiple of the key tile, not a multiple, smaller than one tile, S = 1; several query blocks;
causal and not; query and key lengths that differ; head dims 64 and 128.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from flashcore_numba import PHASES, check_close, lowp_attention, reference_attention
from flashcore_numba.reference import random_qkv


def run_phase(phase, q, k, v, causal, config=None):
    """Launch a phase (or `config`, one of its builds) on poisoned output memory and return what
    it wrote."""
    from numba import cuda

    from flashcore_numba.phases.common import LOG2E

    D = q.shape[-1]
    out = cuda.to_device(np.full(q.shape, np.nan, dtype=np.float16))  # poison: unwritten -> NaN
    config = config or PHASES[phase].build(D)
    config.launch(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v), out, causal, LOG2E / np.sqrt(D))
    return out.copy_to_host()


def check(phase, shape, seq_k=None, causal=False, scale=1.0):
    q, k, v = random_qkv(shape, seq_k, seed=None, scale=scale)  # fresh inputs every run
    out = run_phase(phase, q, k, v, causal)
    verdict = check_close(out, reference_attention(q, k, v, causal=causal),
                          lowp_attention(q, k, v, causal=causal))
    assert verdict.ok, f"phase {phase} {shape} seq_k={seq_k} causal={causal}: {verdict.message}"


# (B, H, S, D), seq_k, causal: one row each, chosen to keep the simulator under a minute per phase.
# The three smallest run by default; the longer rows (whole tiles, a tail over two tiles, D = 128)
# are marked slow (.ci/run runs them).
# Causal rows that see no key (S_q=12 S_k=5) are tests/test_properties.py's
# test_rows_without_keys_are_zero: every phase, the same shape with 2 heads, the same check
# against the reference plus exact zeros and no NaN (a row here as well ran that launch twice).
CASES = [
    pytest.param((1, 1, 64, 64), None, False, id="S=64 whole tiles", marks=pytest.mark.slow),
    pytest.param((1, 1, 70, 64), None, True, id="S=70 tail, causal", marks=pytest.mark.slow),
    pytest.param((1, 2, 12, 64), None, False, id="S=12 under one tile, 2 heads"),
    pytest.param((2, 1, 1, 64), None, True, id="S=1, batch 2, causal"),
    pytest.param((1, 1, 9, 64), 40, True, id="S_q=9 S_k=40 causal (bottom-right)"),
    pytest.param((1, 1, 33, 128), None, True, id="D=128 S=33 causal", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("phase", sorted(PHASES))
@pytest.mark.parametrize("shape,seq_k,causal", CASES)
def test_phase_matches_reference(phase, shape, seq_k, causal):
    check(phase, shape, seq_k, causal)


@pytest.mark.parametrize("phase", sorted(PHASES))
def test_large_logits(phase):
    """Scores around ±30: exp2 without the running max would overflow fp32."""
    check(phase, (1, 1, 24, 64), causal=False, scale=2.4)


@pytest.mark.parametrize("phase", sorted(PHASES))
@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_negative_and_zero_scale(phase, scale):
    """attention() takes any finite scale: negative flips which keys win, zero averages v."""
    from flashcore_numba import attention

    q, k, v = random_qkv((1, 1, 20, 64), 23)
    out = attention(q, k, v, causal=True, scale=scale, phase=phase)
    verdict = check_close(out, reference_attention(q, k, v, causal=True, scale=scale),
                          lowp_attention(q, k, v, causal=True, scale=scale))
    assert verdict.ok, f"phase {phase} scale={scale}: {verdict.message}"


@pytest.mark.parametrize("phase", sorted(PHASES))
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the emulated mma's inf - inf
def test_infinities_and_nan_propagate_as_in_torch(phase, causal):
    """docs/guide.md, "Infinities and NaN": a +inf or NaN score makes its row NaN, a -inf score is a
    key of weight 0 (a row with nothing else gives zeros), inf and NaN in v reach the columns they
    sit in; every other output is finite and correct. The cases are listed in nonfinite_qkv."""
    from flashcore_numba.reference import check_nonfinite, nonfinite_qkv

    q, k, v = nonfinite_qkv((1, 1, 20, 64), causal=causal)  # 20 keys: two of the simulator's key tiles
    out = run_phase(phase, q, k, v, causal)
    verdict = check_nonfinite(out, reference_attention(q, k, v, causal=causal),
                              lowp_attention(q, k, v, causal=causal))
    assert verdict.ok, f"phase {phase} causal={causal}: {verdict.message}"


def test_every_phase_declares_the_contract():
    for pid, module in PHASES.items():
        assert module.ID == pid and module.NAME and module.TITLE
        assert set(module.HEAD_DIMS) >= {64, 128}
        assert "[measured:begin]" in module.__doc__ and "What changed" in module.__doc__ or pid == "01"


GQA_PHASES = [pid for pid, module in sorted(PHASES.items()) if getattr(module, "GQA", False)]


@pytest.mark.parametrize("phase", GQA_PHASES)
@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])
def test_grouped_query_attention(phase, causal):
    """4 query heads on 2 key/value heads: head h reads k/v head h // 2 (through the public API)."""
    from flashcore_numba import attention

    q, _, _ = random_qkv((1, 4, 20, 64))
    _, k, v = random_qkv((1, 2, 27, 64))
    out = attention(q, k, v, causal=causal, phase=phase)
    k_rep, v_rep = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    verdict = check_close(out, reference_attention(q, k_rep, v_rep, causal=causal),
                          lowp_attention(q, k_rep, v_rep, causal=causal))
    assert verdict.ok, f"phase {phase} GQA causal={causal}: {verdict.message}"


def test_gqa_is_refused_by_phases_without_it():
    from flashcore_numba import attention

    q, _, _ = random_qkv((1, 4, 8, 64))
    _, k, v = random_qkv((1, 2, 8, 64))
    with pytest.raises(ValueError, match="k: 2 heads differ from q's 4; phase 05"):
        attention(q, k, v, phase="05")


BF16_PHASES = [pid for pid, module in sorted(PHASES.items()) if "bfloat16" in getattr(module, "DTYPES", ())]


def run_bf16(phase, q, k, v, causal):
    """A bf16 kernel on bf16 bit patterns (NumPy has no bf16): float32 in, the bf16 output as float32."""
    from numba import cuda

    from flashcore_numba import phases
    from flashcore_numba.phases.common import LOG2E
    from flashcore_numba.reference import bf16_bits, bf16_to_float

    D = q.shape[-1]
    out = cuda.to_device(np.full(q.shape, 0x7FC0, dtype=np.int16))  # poison: bf16 NaN
    config = phases.build(PHASES[phase], D, "bfloat16")
    config.launch(*(cuda.to_device(bf16_bits(x)) for x in (q, k, v)), out, causal, LOG2E / np.sqrt(D))
    return bf16_to_float(out.copy_to_host())


@pytest.mark.parametrize("phase", BF16_PHASES)
@pytest.mark.parametrize("shape,seq_k,causal", [
    pytest.param((1, 1, 40, 64), 37, False, id="S_q=40 S_k=37", marks=pytest.mark.slow),
    pytest.param((1, 1, 33, 128), 50, True, id="D=128 S_q=33 S_k=50 causal"),  # D = 128 by default
])
def test_bf16_matches_reference(phase, shape, seq_k, causal):
    """bf16 inputs, rounded to bf16 first; the yardstick is the same attention rounded to bf16."""
    from flashcore_numba.reference import round_to

    q, k, v = (round_to(x, "bfloat16") for x in random_qkv(shape, seq_k, dtype=np.float32))
    out = run_bf16(phase, q, k, v, causal)
    verdict = check_close(out, reference_attention(q, k, v, causal=causal),
                          lowp_attention(q, k, v, causal=causal, dtype="bfloat16"))
    assert verdict.ok, f"phase {phase} bf16 {shape} seq_k={seq_k} causal={causal}: {verdict.message}"


def test_bf16_oracle_is_not_the_fp16_one():
    """bf16 keeps 8 significant bits, fp16 11: the bf16 yardstick must be the looser one, and a
    kernel that read bf16 bits as fp16 would be far outside it."""
    from flashcore_numba.reference import bf16_bits, round_to

    q, k, v = (round_to(x, "bfloat16") for x in random_qkv((1, 1, 16, 64), dtype=np.float32))
    ref = reference_attention(q, k, v)
    err_bf16 = np.abs(lowp_attention(q, k, v, dtype="bfloat16") - ref).max()
    err_fp16 = np.abs(lowp_attention(q, k, v) - ref).max()
    assert err_bf16 > 2 * err_fp16 > 0
    misread = np.asarray(bf16_bits(q)).view(np.float16).astype(np.float64)  # bf16 bits taken as fp16
    assert not check_close(misread, ref, lowp_attention(q, k, v, dtype="bfloat16")).ok


@pytest.mark.parametrize("variant", ["09-ws", "09-turns", "09-overlap"])
def test_phase09_variants_match_reference(variant):
    """The builds that leave one idea of phase 09 out (or add one) compute the same attention."""
    from flashcore_numba import attention

    q, k, v = random_qkv((1, 1, 70, 64))
    out = attention(q, k, v, causal=True, phase=variant)
    verdict = check_close(out, reference_attention(q, k, v, causal=True), lowp_attention(q, k, v, causal=True))
    assert verdict.ok, f"{variant}: {verdict.message}"



@pytest.mark.parametrize("variant", ["09", "09-ws"])
def test_phase09_passes_the_tiles_a_consumer_never_sees(variant):
    """S_q=100, S_k=160, causal (bottom-right): the block's 128 rows need two tiles of 128 keys, but
    the first consumer's rows (0..63) see keys up to 123 only, in tile 0. That consumer computes
    tile 0 and passes tile 1 on (its turn, its stage) without reading it."""
    from flashcore_numba import attention
    from flashcore_numba.phases import p09_warp_specialized as p09

    L = p09.layout(64)
    assert L["PASS_UNSEEN"] and L["BLOCK_M"] == 128 and L["BLOCK_N"] == 128  # the simulator's layout
    q, k, v = random_qkv((1, 1, 100, 64), 160)
    out = attention(q, k, v, causal=True, phase=variant)
    verdict = check_close(out, reference_attention(q, k, v, causal=True), lowp_attention(q, k, v, causal=True))
    assert verdict.ok, f"{variant}: {verdict.message}"


@pytest.mark.parametrize("variant", ["09", "09-ws"])
def test_phase09_consumers_without_rows_pass_a_whole_ring(variant):
    """S_q=64, S_k=640: the block's second consumer has no rows and passes all five tiles, more than
    the ring's four stages. Each pass waits for its tile to land before it releases the stage: 09-ws
    has no turns to hold that consumer back, and without the wait its second release of stage 0
    counted towards the first use, so the producer refilled a stage still being read (wrong output
    here; a deadlock on the H100)."""
    from flashcore_numba import attention
    from flashcore_numba.phases import p09_warp_specialized as p09

    L = p09.layout(64)
    assert L["BLOCK_M"] == 128 and L["STAGES"] == 4 and 640 // L["BLOCK_N"] > L["STAGES"]  # the simulator's
    q, k, v = random_qkv((1, 1, 64, 64), 640)
    out = attention(q, k, v, phase=variant)
    verdict = check_close(out, reference_attention(q, k, v), lowp_attention(q, k, v))
    assert verdict.ok, f"{variant}: {verdict.message}"


def test_phase09_trace_build_records_every_block_and_role():
    """The trace build (docs/tuning/09_history.md) computes the same attention, and its records add up:
    4 query blocks over 2 persistent blocks, each taken by the producer and by both consumers of the
    block that took it, every role's end after its start, and a wait on a K/V stage per tile."""
    from numba import cuda

    from flashcore_numba.measure import trace
    from flashcore_numba.phases.common import LOG2E

    q, k, v = random_qkv((1, 4, 20, 64), 40)
    config = trace.trace_config(64)
    out = cuda.to_device(np.full(q.shape, np.nan, dtype=np.float16))
    records = trace.traced_launch(config, *(cuda.to_device(x) for x in (q, k, v)), out, True, LOG2E / 8)
    verdict = check_close(out.copy_to_host(), reference_attention(q, k, v, causal=True),
                          lowp_attention(q, k, v, causal=True))
    assert verdict.ok, verdict.message
    assert records.shape[:2] == (2, 3)  # two blocks (the simulator's SMs); the producer and two consumers
    units = records[:, :, 3]
    assert units[:, 0].sum() == 4 and (units[:, 1:] == units[:, :1]).all()
    s = trace.summary(records)
    assert s["span_ns"] > 0 and all(trace.rel(records[b, r, 2], records[b, r, 0]) >= 0
                                    for b in range(2) for r in range(3))
    assert s["wait_count"]["full"] == 2 * 4  # each consumer waits for the one tile of each of its 4 query blocks
    assert s["wait_count"]["q_full"] == 2 * (4 + 2)  # and for Q: once per query block, once more to hear "done"


def test_phase09_grid_is_persistent():
    """Phase 09 launches one block per SM (two in the simulator), each looping over query blocks;
    09-overlap one block per query block. The grouped-query test above runs 09 with 4 units (one
    query block in each of 4 heads) on those 2 blocks, so a block there takes more than one."""
    from flashcore_numba.phases import p09_warp_specialized as p09

    shape = (1, 4, 20, 64)
    assert p09.build(64).work_units(shape, True) == 4
    assert p09.build(64).grid(shape, True) == (2,)
    assert p09.build(64, "overlap").grid(shape, True) == (4,)
    assert p09.build(64).grid((1, 1, 1, 64), False) == (1,)


def test_phase09_leaves_its_work_counter_at_zero():
    """Phase 09's blocks take query blocks from a counter; the request that gets the launch's last
    block sets it back to zero, so no memset precedes the next launch. Two launches share one
    counter here (4 units on the simulator's 2 blocks, so the counter hands out units): without
    the reset the second would find it at 4, hand no unit out past the first two blocks' own, and
    leave rows of its poisoned output unwritten."""
    from numba import cuda

    from flashcore_numba.phases import p09_warp_specialized as p09
    from flashcore_numba.phases.common import LOG2E

    q, k, v = random_qkv((1, 4, 20, 64))
    config = p09.build(64)
    counter = cuda.to_device(np.zeros(1, np.int32))
    ref, lowp = reference_attention(q, k, v, causal=True), lowp_attention(q, k, v, causal=True)
    for launch in range(2):
        out = cuda.to_device(np.full(q.shape, np.nan, dtype=np.float16))
        args = config.arguments(*(cuda.to_device(x) for x in (q, k, v)), out, True, LOG2E / 8)
        config.kernel[config.grid(q.shape, True), config.n_threads, 0, config.smem_bytes](*args[:-1], counter)
        assert counter.copy_to_host()[0] == 0, f"launch {launch}: the counter was left at {counter.copy_to_host()[0]}"
        verdict = check_close(out.copy_to_host(), ref, lowp)
        assert verdict.ok, f"launch {launch}: {verdict.message}"


def test_phase09_builds_one_description_per_variant():
    """Each build of phase 09 is one frozen Build: one per variant, all different, the persistent
    grid phase 09's alone, and the trace build of measure.trace is phase 09's with trace on."""
    import dataclasses

    from flashcore_numba.measure.trace import trace_config
    from flashcore_numba.phases import p09_warp_specialized as p09

    assert set(p09.BUILDS) == {None, *p09.VARIANTS}
    assert len(set(p09.BUILDS.values())) == len(p09.BUILDS)
    assert [v for v, b in p09.BUILDS.items() if b.persistent] == [None]
    assert not p09.BUILDS["ws"].turns and p09.BUILDS["ws"].uniform_c
    assert not p09.BUILDS["turns"].uniform_c and not p09.BUILDS["turns"].release_q_early
    with pytest.raises(dataclasses.FrozenInstanceError):
        p09.BUILDS[None].overlap = False
    assert trace_config(64, variant="turns").persistent is False
    with pytest.raises(ValueError, match="variant: expected None or one of ws, turns, overlap, got 'fast'"):
        p09.build(64, "fast")


def test_persistent_grid_size_from_a_tests_override(monkeypatch):
    """A test may run a persistent grid on fewer blocks than the GPU has SMs (common.sm_count_override);
    without it the grid is the device's count (the simulator's two here), and a bad value is named."""
    from flashcore_numba.phases import common
    from flashcore_numba.phases import p09_warp_specialized as p09

    shape = (2, 4, 20, 64)  # 8 units
    assert p09.build(64).grid(shape, False) == (common.SIM_SMS,)
    monkeypatch.setattr(common, "sm_count_override", 3)
    assert p09.build(64).grid(shape, False) == (3,)
    monkeypatch.setattr(common, "sm_count_override", 0)
    with pytest.raises(ValueError, match="sm_count_override: expected None or a positive number of blocks, got 0"):
        p09.build(64).grid(shape, False)


def test_shared_memory_limit_is_raised_once_per_specialization(monkeypatch):
    """launch() raises a kernel's dynamic shared-memory limit before every launch that needs more
    than 48 KB; the driver call is made once per compiled specialization, which the arguments'
    Numba types select: again for arrays of another dtype (a NumPy array has no cached Numba
    type to key on), not again for the same types."""
    import numba
    from cuda.bindings import driver

    from flashcore_numba.arch import smem

    calls, compiled = [], []

    class Kernel:  # what raise_dynamic_smem_limit uses of a numba-cuda dispatcher
        typeof_pyval = staticmethod(numba.typeof)

        def compile(self, argtypes):
            compiled.append(argtypes)
            cufunc = SimpleNamespace(handle=len(compiled))
            return SimpleNamespace(library=SimpleNamespace(get_cufunc=lambda: cufunc))

    def set_attribute(attr, nbytes, handle, device_id):
        calls.append((handle, nbytes))
        return (driver.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(driver, "cuKernelSetAttribute", set_attribute)
    monkeypatch.setattr(smem, "cuda", SimpleNamespace(get_current_device=lambda: SimpleNamespace(id=0)))
    monkeypatch.setattr(smem, "_smem_limit_raised", set())
    kernel = Kernel()
    half, single = np.zeros(4, np.float16), np.zeros(4, np.float32)
    for args in ((half, True, 0.5), (half, False, 0.25), (single, True, 0.5), (half, True, 0.5)):
        smem.raise_dynamic_smem_limit(kernel, args, 100_000)
    assert calls == [(1, 100_000), (2, 100_000)]
    assert [t[0] for t in compiled] == [numba.typeof(half), numba.typeof(single)]
    smem.raise_dynamic_smem_limit(kernel, (half, True, 0.5), 120_000)  # more bytes: asked again
    assert calls[-1] == (3, 120_000)


# ---------------------------------------------------------------------------------------------
# Phase 10: split keys
# ---------------------------------------------------------------------------------------------
def test_phase10_split_count_fills_the_gpu_once():
    """As many blocks per row tile as fill the GPU's slots in one wave (never part of a second),
    each warp's range at least MIN_TILES_PER_SPLIT tiles, at most MAX_SPLITS ranges, evened out;
    none where the blocks fill it."""
    from flashcore_numba.phases.p10_split_keys import MAX_SPLITS, MIN_TILES_PER_SPLIT, WARPS, split_count

    assert MIN_TILES_PER_SPLIT == 4 and MAX_SPLITS == 256 and WARPS == 4
    # an H100 holds one block of four warps per SM: 132 slots
    assert split_count(blocks=8, key_tiles=1024, slots=132) == 16  # B=1 H_kv=8 S_k=32768: 64 ranges of 16 tiles
    assert split_count(blocks=8, key_tiles=256, slots=132) == 16  # S_k=8192: 64 ranges of 4 tiles
    assert split_count(blocks=16, key_tiles=128, slots=132) == 8  # B=1 H=16 S_k=4096: 32 ranges of 4
    assert split_count(blocks=256, key_tiles=64, slots=132) == 1  # 8 x 32 heads: more blocks than slots
    assert split_count(blocks=100, key_tiles=1000, slots=132) == 1  # 2 x 100 would be part of a second wave
    assert split_count(blocks=1, key_tiles=4000, slots=132) == 63  # at most 256 ranges: 250 of 16 tiles
    assert split_count(blocks=1, key_tiles=15, slots=132) == 1  # under two blocks' worth of keys
    assert split_count(blocks=4, key_tiles=40, slots=132) == 2
    assert split_count(blocks=4, key_tiles=20, slots=792, min_tiles=1, warps=1) == 20  # one warp a block
    assert split_count(blocks=1, key_tiles=9, slots=8, min_tiles=1, warps=2) == 3  # 8 ranges: 5 of 2 tiles
    for warps in (1, 2, 4):
        for blocks in (1, 3, 50):
            for key_tiles in range(1, 300, 7):
                n = split_count(blocks, key_tiles, 132, warps=warps)
                per = -(-key_tiles // (n * warps))  # tiles per warp's range
                assert 1 <= n * warps <= MAX_SPLITS and n * blocks <= max(132, blocks), (warps, blocks, key_tiles)
                assert n == 1 or (n - 1) * warps * per < key_tiles, (warps, blocks, key_tiles, n)  # no empty block


def split_config(D, splits, dtype="float16"):
    """Phase 10's kernel with `splits` key ranges whatever the shape (the rule would split the
    simulator's tiny problems once or not at all)."""
    import dataclasses
    from functools import partial

    from flashcore_numba.phases import p10_split_keys as p10

    config = p10.build(D, dtype=dtype)
    return dataclasses.replace(config, split_keys=partial(config.split_keys, splits=splits))


# Each case with one split count, not all three: the tree's shape depends on the count alone (in
# the simulator's teams of two, 2 splits merge over one level; 3 over two, a team of one carried up;
# 5 over three, teams carried and some warps' ranges empty), each case's subject on the rows and
# their keys. 5 splits, the deepest, go to the case with several (batch, K/V head) pairs' counters
# and to rows that see no key. The other counts at such shapes: 2 splits of packed, causal, drafted
# rows in test_phase10_pipeline_of_other_stage_counts; 3 of two row tiles in
# test_phase10_merge_keeps_infinities_of_v[3], and of a group of 4 in
# test_phase10_leaves_its_counters_at_zero.
@pytest.mark.parametrize("case, splits", [
    pytest.param(dict(shape=(2, 4, 1, 64), seq_k=100, heads_kv=2, causal=False), 5, id="decode, GQA 2-5",
                 marks=pytest.mark.slow),
    pytest.param(dict(shape=(1, 8, 3, 64), seq_k=90, heads_kv=2, causal=True), 3,
                 id="3 drafted rows, GQA 4, causal-3"),
    pytest.param(dict(shape=(1, 2, 20, 64), seq_k=70, heads_kv=2, causal=True), 2,
                 id="20 rows: two row tiles-2", marks=pytest.mark.slow),
    pytest.param(dict(shape=(1, 1, 24, 64), seq_k=10, heads_kv=1, causal=True), 5, id="rows without keys-5"),
])
def test_phase10_splits_merge_to_the_reference(case, splits):
    """The partial outputs of every split, merged by the last block through their log-sum-exps,
    give the output and the LSE of the whole: on poisoned memory, with grouped query heads packed
    as rows (the causal mask per row's own position), several row tiles, and rows that see no key
    in any split (output 0, LSE -inf); over one, two and three levels of merges."""
    from numba import cuda

    from flashcore_numba.phases.common import LOG2E
    from flashcore_numba.reference import reference_lse

    q, k, v = random_qkv(case["shape"], case["seq_k"], seed=None, heads_kv=case["heads_kv"])
    causal, D = case["causal"], q.shape[-1]
    config = split_config(D, splits)
    assert config.grid(q.shape, causal, k.shape)[0] == splits
    out = cuda.to_device(np.full(q.shape, np.nan, np.float16))
    lse = cuda.to_device(np.full(q.shape[:3], np.nan, np.float32))
    config.launch(*(cuda.to_device(x) for x in (q, k, v)), out, causal, LOG2E * 0.3, lse=lse)
    verdict = check_close(out.copy_to_host(), reference_attention(q, k, v, causal=causal, scale=0.3),
                          lowp_attention(q, k, v, causal=causal, scale=0.3))
    assert verdict.ok, verdict.message
    ref = reference_lse(q, k, causal=causal, scale=0.3)
    got = lse.copy_to_host()
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    seen = ~np.isneginf(ref)
    np.testing.assert_allclose(got[seen], ref[seen], rtol=1e-5, atol=1e-5)


def test_phase10_merge_counters_count_every_team_of_the_tree():
    """One counter per team at each level of the merge tree, down to the team that writes the
    output: 79 splits in teams of 16 are 5 teams, then 1."""
    from flashcore_numba.phases.p10_split_keys import merge_counters

    assert merge_counters(1, 16) == 1 and merge_counters(16, 16) == 1 and merge_counters(17, 16) == 3
    assert merge_counters(79, 16) == 6 and merge_counters(256, 16) == 17
    assert merge_counters(37, 2) == 19 + 10 + 5 + 3 + 2 + 1


def test_phase10_merges_over_several_levels():
    """9 blocks (of two warps, merged first) in the simulator's teams of two: four levels of merges
    across blocks (5, 3, 2 and 1 teams), a team of one at the end of each of the first three carried
    up (test_phase10_merge_counters_count_every_team_of_the_tree counts the counters of deeper trees)."""
    from flashcore_numba.phases.p10_split_keys import SIM_FAN_IN, merge_counters

    assert SIM_FAN_IN == 2 and merge_counters(9, SIM_FAN_IN) == 5 + 3 + 2 + 1
    q, k, v = random_qkv((1, 2, 1, 64), 9 * 2 * 16, seed=None, heads_kv=1)  # a tile per warp
    out = run_phase("10", q, k, v, False, split_config(64, 9))
    verdict = check_close(out, reference_attention(q, k, v), lowp_attention(q, k, v))
    assert verdict.ok, verdict.message


def test_phase10_rescales_only_when_a_maximum_passes_the_margin():
    """The running maxima move only when a row of the warp sees a score more than RESCALE_MARGIN
    (log2 units) above its m_i: scores that climb tile by tile, by less than the margin (no
    rescale: p up to 2^8 against the old m_i), then by far more (the vote rescales every row of
    the warp, those whose maxima did not move too), in both warps' ranges. Rows 4-7 of each head
    climb a tenth as far and never pass the margin after their first tile: they are the rows of
    lanes 16-31 (lane l holds packed rows l // 4 and l // 4 + 8), so the vote is of some lanes,
    not all. Output and log-sum-exp as the float64 reference's."""
    from numba import cuda

    from flashcore_numba.phases import p10_split_keys as p10
    from flashcore_numba.phases.common import LOG2E
    from flashcore_numba.reference import reference_lse

    D, BLOCK_N = 64, p10.SIM_TILES[64]["block_n"]
    assert p10.SIM_WARPS == 2 and p10.RESCALE_MARGIN == 8.0
    climb = np.array([0.0, 3.0, 25.0, 0.0, 4.0, 18.0])  # natural-log units a tile: warp 0 has tiles 0-2
    assert (np.diff(climb)[[0, 3]] * LOG2E < p10.RESCALE_MARGIN).all()  # tiles 1 and 4: within the margin
    assert (np.diff(climb)[[1, 4]] * LOG2E > p10.RESCALE_MARGIN).all()  # tiles 2 and 5: far past it
    q, k, v = random_qkv((1, 2, 8, D), len(climb) * BLOCK_N, seed=None, heads_kv=1, scale=0.3)
    q[..., 0] = 1.0
    q[0, :, 4:, 0] = 0.1  # rows 4-7 of both heads (packed rows 4-7 and 12-15) climb a tenth as far
    k[0, 0, :, 0] = np.repeat(climb, BLOCK_N) * np.sqrt(D)  # score = q k / sqrt(D): climb[tile] in row 0
    out = cuda.to_device(np.full(q.shape, np.nan, np.float16))
    lse = cuda.to_device(np.full(q.shape[:3], np.nan, np.float32))
    config = split_config(D, 1)
    assert config.grid(q.shape, False, k.shape)[0] == 1  # one block: each warp a range of 3 tiles
    config.launch(*(cuda.to_device(x) for x in (q, k, v)), out, False, LOG2E / np.sqrt(D), lse=lse)
    verdict = check_close(out.copy_to_host(), reference_attention(q, k, v), lowp_attention(q, k, v))
    assert verdict.ok, verdict.message
    np.testing.assert_allclose(lse.copy_to_host(), reference_lse(q, k), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("splits", [1, 3])
def test_phase10_merge_keeps_infinities_of_v(splits):
    """An inf of v stays inf through the merge's weights and sums, where torch has inf (one block:
    its warps' merge writes the output; three: the last team of blocks has one member)."""
    from flashcore_numba.reference import check_nonfinite, nonfinite_qkv

    q, k, v = nonfinite_qkv((1, 1, 20, 64), causal=False)
    out = run_phase("10", q, k, v, False, split_config(64, splits))
    verdict = check_nonfinite(out, reference_attention(q, k, v), lowp_attention(q, k, v))
    assert verdict.ok, verdict.message


@pytest.mark.parametrize("stages", [2, 4])
def test_phase10_pipeline_of_other_stage_counts(stages):
    """The kernel with 2 or 4 stages of K and V (the GPU's has 3; split_layout takes 2 to 4): the
    prologue's STAGES - 1 groups, the wait for the oldest and the stage each copy overwrites, over
    ranges of 1 to 5 tiles (the last one short), several splits merged."""
    import dataclasses
    from functools import partial

    from flashcore_numba.phases import p10_split_keys as p10

    L = p10.split_layout(64, 16, stages)
    assert L["SMEM_BYTES"] == L["K_OFF"] + stages * L["STAGE_BYTES"]
    config = p10.build_kernel(L)
    config = dataclasses.replace(config, split_keys=partial(config.split_keys, splits=2))
    q, k, v = random_qkv((1, 2, 3, 64), 150, seed=None, heads_kv=1)  # 10 tiles: two splits of 5
    out = run_phase("10", q, k, v, True, config)
    verdict = check_close(out, reference_attention(q, k, v, causal=True),
                          lowp_attention(q, k, v, causal=True))
    assert verdict.ok, verdict.message
    with pytest.raises(AssertionError, match="wait_group"):
        p10.split_layout(64, 16, 5)


def test_phase10_leaves_its_counters_at_zero():
    """The block that merges a team sets its counter back to zero: two launches share one
    workspace, and the second merges as the first did (without the reset, no block of the second
    would count to the last and its rows would stay poisoned)."""
    from numba import cuda

    from flashcore_numba.phases.common import LOG2E

    q, k, v = random_qkv((1, 4, 2, 64), 80, heads_kv=1)  # 8 packed rows, one row tile
    config = split_config(64, 3)
    splits = config.split_keys(q.shape, k.shape, False)
    assert splits.counters == 3 and splits.o_part == (3, 8, 64)  # 3 blocks (of 2 warps); teams of two: 2, then 1
    workspace = (cuda.device_array(splits.o_part, np.float32), cuda.device_array(splits.lse_part, np.float32),
                 cuda.to_device(np.zeros(splits.counters, np.int32)))
    ref, lowp = reference_attention(q, k, v), lowp_attention(q, k, v)
    for launch in range(2):
        out = cuda.to_device(np.full(q.shape, np.nan, np.float16))
        args = config.arguments(*(cuda.to_device(x) for x in (q, k, v)), out, False, LOG2E / 8)
        config.kernel[splits.grid, config.n_threads, 0, config.smem_bytes](*args[:-3], *workspace)
        assert not workspace[2].copy_to_host().any(), f"launch {launch}: a counter was left non-zero"
        verdict = check_close(out.copy_to_host(), ref, lowp)
        assert verdict.ok, f"launch {launch}: {verdict.message}"


def test_phase10_grid_packs_a_groups_rows():
    """The grid is (splits, row tiles x K/V heads, batch): a group's query heads times S_q rows
    make one sequence of packed rows, cut into tiles of 16."""
    config = split_config(64, 1)
    assert config.grid((2, 32, 1, 64), False, (2, 8, 500, 64)) == (1, 8, 2)  # 4 rows per K/V head
    assert config.grid((2, 32, 5, 64), False, (2, 8, 500, 64)) == (1, 16, 2)  # 20 rows: 2 tiles
    assert split_config(64, 6).grid((1, 16, 1, 64), True, (1, 16, 4096, 64)) == (6, 16, 1)


def test_phase10_batch_variant_holds_two_blocks_an_sm(monkeypatch):
    """The variant "batch" as the GPU builds it: BATCH_WARPS warps a block, whose shared memory lets
    two blocks share an H100's SM where the four-warp build holds one; "batch_fills_gpu" hands it a
    problem whose row tiles are at least the SMs. In the simulator it is the phase's own build
    (SIM_WARPS), and gives the reference's answer."""
    from flashcore_numba.phases import KERNELS, common
    from flashcore_numba.phases import p10_split_keys as p10
    from flashcore_numba.phases.common import H100_SM_LIMITS, blocks_per_sm

    assert p10.BATCH_WARPS < p10.WARPS and set(p10.VARIANTS) == {"batch"}
    for D in p10.HEAD_DIMS:
        L = p10.gpu_layout(D)
        assert blocks_per_sm(p10.smem_size(L, p10.WARPS), H100_SM_LIMITS) == 1, D
        assert blocks_per_sm(p10.smem_size(L, p10.BATCH_WARPS), H100_SM_LIMITS) == 2, D
    monkeypatch.setattr(common, "sm_count_override", 132)
    assert not p10.batch_fills_gpu(131, 1) and p10.batch_fills_gpu(132, 1) and p10.batch_fills_gpu(2048, 16)
    assert p10.batch_fills_gpu(66, 20) and not p10.batch_fills_gpu(65, 16)  # 20 rows: two row tiles a head
    with pytest.raises(ValueError, match="variant"):
        p10.build(64, "wide")
    monkeypatch.setattr(common, "sm_count_override", None)
    q, k, v = random_qkv((3, 4, 1, 64), 40, seed=None, heads_kv=2)
    out = run_phase("10", q, k, v, True, KERNELS["10-batch"].build(64))
    verdict = check_close(out, reference_attention(q, k, v, causal=True), lowp_attention(q, k, v, causal=True))
    assert verdict.ok, verdict.message


@pytest.mark.parametrize("D", [
    pytest.param(40, id="D=40: 64-column tiles", marks=pytest.mark.slow),
    pytest.param(96, id="D=96: 128-column tiles"),
    pytest.param(160, id="D=160: 256-column tiles", marks=pytest.mark.slow),
    pytest.param(256, id="D=256", marks=pytest.mark.slow),
])
def test_phase10_other_head_dims_round_up_their_tiles(D):
    """Phase 10's kernel at a head dim of neither course size: its tiles hold D_TILE columns (64, 128
    or 256: tile_head_dim), the copies fill the columns past D with zeros and the partials keep D;
    split across 3 ranges, causal, GQA, on poisoned output, against the reference."""
    from numba import cuda

    from flashcore_numba.phases import p10_split_keys as p10
    from flashcore_numba.phases.common import LOG2E

    assert p10.tile_head_dim(D) == {40: 64, 96: 128, 160: 256, 256: 256}[D]
    assert p10.runs_head_dim(D) and not p10.runs_head_dim(D + 4)
    q, k, v = random_qkv((1, 4, 2, D), 70, seed=None, heads_kv=2)
    out = cuda.to_device(np.full(q.shape, np.nan, np.float16))
    config = split_config(D, 3)
    config.launch(*(cuda.to_device(x) for x in (q, k, v)), out, True, LOG2E * 0.3)
    verdict = check_close(out.copy_to_host(), reference_attention(q, k, v, causal=True, scale=0.3),
                          lowp_attention(q, k, v, causal=True, scale=0.3))
    assert verdict.ok, verdict.message


def test_phase10_tiles_of_every_head_dim_fit_an_sm():
    """On the GPU, each D_TILE's block of four warps fits one SM's shared memory (227 KB a block), and
    the variant "batch", two warps, fits twice."""
    from flashcore_numba.phases import p10_split_keys as p10
    from flashcore_numba.phases.common import H100_SM_LIMITS, blocks_per_sm

    for D in range(8, 257, 8):
        L = p10.gpu_layout(D)
        assert L["STRIDE"] == p10.tile_head_dim(D) and L["GLOBAL_CHUNKS"] * 8 == D, D
        assert p10.smem_size(L, p10.WARPS) <= 227 * 1024, D
        assert blocks_per_sm(p10.smem_size(L, p10.WARPS), H100_SM_LIMITS) == 1, D
        assert blocks_per_sm(p10.smem_size(L, p10.BATCH_WARPS), H100_SM_LIMITS) == 2, D
