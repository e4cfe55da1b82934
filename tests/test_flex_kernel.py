"""Phase 14's kernel (phases/p14_flex.py) through flex_attention (api.py): score_mod and mask_mod compiled
into phase 07's kernel (or phase 09's: phase="09"), the block mask's empty tiles never read. Every output against the float64
oracle with the same mods (reference.reference_flex), in the simulator on the CPU and on a GPU."""

import numpy as np
import pytest

from flashcore_numba import flex, flex_attention
from flashcore_numba.phases import p14_flex
from flashcore_numba.reference import random_qkv, reference_flex

NO_TORCH = "torch is not installed (pip install -e '.[torch]')"
ATOL = 2e-3  # fp16 output of a float32 softmax against float64, inputs of |x| < 4 (as test_phases)


def check(q, k, v, *, score_mod=None, mask_mod=None, block_mask=None, scale=None, phase=None):
    """flex_attention's output and LSE against the oracle: every row, NaN never passes; a row that
    sees no key is exactly zero with an LSE of -inf."""
    out, lse = flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                              scale=scale, return_lse=True, phase=phase)
    mask = block_mask.mask if block_mask is not None else mask_mod
    ref, ref_lse = reference_flex(q, k, v, score_mod=score_mod, mask_mod=mask, scale=scale)
    got = np.asarray(out, np.float64)
    assert not np.isnan(got).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(got, ref, atol=ATOL, rtol=0)
    seen = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), seen)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], atol=1e-4, rtol=1e-5)
    assert not got[~seen].any()
    return out


def test_block_lists_walk_the_visited_tiles_in_order():
    kinds = np.array([[[[0, 2, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]]], np.int8)
    count, index = p14_flex.block_lists(kinds)
    assert count.tolist() == [[[2, 0, 4]]]
    assert index[0, 0, 0, :2].tolist() == [1, 2] and index[0, 0, 2].tolist() == [0, 1, 2, 3]
    assert (index >= 0).all() and (index < 4).all()


@pytest.mark.beside
def test_softcap_and_a_sliding_window_in_the_simulator():
    """A score_mod and a mask_mod together, GQA 2, lengths that end inside a tile on both sides, the
    window leaving some tiles empty (the simulator's tiles: 32 x 32)."""
    q, k, v = random_qkv((1, 2, 70, 64), 75, heads_kv=1, seed=3, dtype=np.float16)
    window = flex.sliding_window(31, 31)  # a whole 32 x 32 tile on the diagonal, none two tiles away
    blocks = flex.create_block_mask(window, None, None, 70, 75, 32, 32)
    assert (blocks.kinds == flex.EMPTY).any() and (blocks.kinds == flex.FULL).any()
    check(q, k, v, score_mod=flex.softcap(3.0), block_mask=blocks)


def test_phase09s_lists_put_the_tiles_without_a_mask_first():
    """hopper_lists: per query block the full tiles first, then the partial ones, each in key order,
    and how many come first; the tile that crosses the last key goes with the masked ones."""
    kinds = np.array([[[[1, 2, 0, 2], [0, 0, 0, 0], [2, 2, 1, 2]]]], np.int8)
    count, index = p14_flex.hopper_lists(kinds, 4 * 16, 16)
    assert count[0, 0].tolist() == [[3, 2], [0, 0], [4, 3]]
    assert index[0, 0, 0, :3].tolist() == [1, 3, 0] and index[0, 0, 2].tolist() == [0, 1, 3, 2]
    count, index = p14_flex.hopper_lists(kinds, 4 * 16 - 5, 16)
    assert count[0, 0, 0].tolist() == [3, 1] and index[0, 0, 0, :3].tolist() == [1, 0, 3]


@pytest.mark.slow  # (a minute in the simulator; the default run's beside child is its longest path)
def test_mods_on_phase09_in_the_simulator():
    """The mods in phase 09's kernel (Hopper's: the TMA producer and the wgmma consumers walk the
    block mask's list, its full tiles first and without a mask; the simulator's tiles: 128 x 128,
    two consumers): a softcap and a window of 300 keys, GQA 2, both lengths ending inside a tile
    (the last key tile, partial, is masked after the full ones); the first query block's list stops
    before the last key tiles."""
    q, k, v = random_qkv((1, 2, 300, 64), 280, heads_kv=1, seed=9, dtype=np.float16)
    window = flex.sliding_window(300)
    blocks = flex.create_block_mask(window, None, None, 300, 280, 128, 128)
    assert blocks.kv_blocks(0, 0, 0).tolist() == [0]
    count, index = p14_flex.hopper_lists(blocks.kinds, 280, 128)
    assert count[0, 0, 2].tolist() == [3, 2] and index[0, 0, 2].tolist() == [0, 1, 2]
    check(q, k, v, score_mod=flex.softcap(4.0), mask_mod=window, phase="09")


@pytest.mark.slow
def test_alibi_and_documents_on_phase09_in_the_simulator():
    """ALiBi and a document mask in phase 09's kernel: the last query block's list starts at key
    block 1 (its first tile is not tile 0), D = 128, the mask per batch."""
    q, k, v = random_qkv((2, 2, 300, 128), 300, seed=10, dtype=np.float16)
    ids = np.stack([np.repeat(np.arange(3), 100), np.repeat(np.arange(2), 150)])
    documents = flex.document_mask(ids, causal=False)
    assert flex.create_block_mask(documents, 2, None, 300, 300, 128, 128).kv_blocks(0, 0, 2).tolist() == [1, 2]
    check(q, k, v, score_mod=flex.alibi(flex.alibi_slopes(2)), mask_mod=documents, phase="09")
    # a query block whose list is empty (its rows see no key: zeros, an LSE of -inf), the next one's partial
    late = flex.mask_mod(lambda b, h, q_idx, kv_idx: (q_idx >= 150) & (kv_idx <= q_idx))
    check(q[:1, :, :, :64].copy(), k[:1, :, :, :64].copy(), v[:1, :, :, :64].copy(), mask_mod=late, phase="09")


def test_flex_attention_names_a_phase_it_does_not_run_on():
    q, k, v = random_qkv((1, 1, 8, 64), 8, seed=1, dtype=np.float16)
    with pytest.raises(ValueError, match="phase: flex_attention runs on phase 07 or 09, not '08'"):
        flex_attention(q, k, v, phase="08")


def test_an_empty_tile_is_never_read():
    """NaN in every key and value of the key blocks a document mask leaves no row of a query block: a
    kernel that loaded or multiplied them would give NaN (0 · NaN), this one gives the oracle's rows."""
    S = 96
    ids = np.repeat(np.arange(3), 32)[None]  # three documents of one tile each
    q, k, v = random_qkv((1, 1, S, 64), S, seed=4, dtype=np.float16)
    mask = flex.document_mask(ids, causal=False)
    blocks = flex.create_block_mask(mask, None, None, S, S, 32, 32)
    assert blocks.kv_blocks(0, 0, 0).tolist() == [0]
    poisoned_k, poisoned_v = k.copy(), v.copy()
    poisoned_k[:, :, 32:], poisoned_v[:, :, 32:] = np.nan, np.nan  # documents 1 and 2
    out = flex_attention(q, poisoned_k, poisoned_v, block_mask=blocks)
    ref, _ = reference_flex(q, k, v, mask_mod=mask)
    np.testing.assert_allclose(np.asarray(out[:, :, :32], np.float64), ref[:, :, :32], atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["alibi+documents", "prefix_lm", "scalar mod", "no mods", "rows see nothing"])
def test_mods_in_the_simulator(case):
    """Each built-in and a user's own mods written for scalars (an `if`), against the oracle."""
    q, k, v = random_qkv((2, 4, 45, 64), 45, heads_kv=2, seed=7, dtype=np.float16)
    if case == "alibi+documents":
        ids = np.stack([np.repeat(np.arange(3), 15), np.repeat(np.arange(5), 9)])
        check(q, k, v, score_mod=flex.alibi(flex.alibi_slopes(4)), mask_mod=flex.document_mask(ids))
    elif case == "prefix_lm":
        check(q, k, v, mask_mod=flex.prefix_lm(10), scale=0.3)
    elif case == "scalar mod":
        table = np.linspace(-1, 1, 4).astype(np.float32)

        def bias(score, b, h, q_idx, kv_idx, table):
            if kv_idx % 2 == 0:
                return score + table[h]
            return score - float(b)

        def every_third(b, h, q_idx, kv_idx):
            return (q_idx + kv_idx) % 3 != 0

        check(q, k, v, score_mod=flex.score_mod(bias, table), mask_mod=every_third)
    elif case == "no mods":
        check(q, k, v)
    else:  # rows 0..19 see no key at all
        def late(b, h, q_idx, kv_idx):
            return q_idx >= 20

        check(q, k, v, mask_mod=late)


def test_a_block_mask_at_other_tiles_is_made_again_at_the_kernels():
    """torch's default block size (128) beside the simulator's 32-row tiles: the kernel's own kinds
    are made from the mask, once, and the answer is the mask's."""
    q, k, v = random_qkv((1, 1, 40, 64), 40, seed=5, dtype=np.float16)
    blocks = flex.create_block_mask(flex.causal_mask(), None, None, 40, 40)  # 128 x 128: one tile
    check(q, k, v, block_mask=blocks)


def test_bad_calls_are_named_before_a_launch():
    q, k, v = random_qkv((1, 2, 16, 64), 16, seed=1, dtype=np.float16)
    window = flex.sliding_window(4)
    with pytest.raises(ValueError, match="give either a block_mask or a mask_mod"):
        flex_attention(q, k, v, block_mask=flex.create_block_mask(window, None, None, 16, 16), mask_mod=window)
    with pytest.raises(ValueError, match="block_mask: made for 16 query rows and 20 keys, but q has 16 and k 16"):
        flex_attention(q, k, v, block_mask=flex.create_block_mask(window, None, None, 16, 20))
    with pytest.raises(ValueError, match="block_mask: made for 3 query heads, the call has 2"):
        flex_attention(q, k, v, block_mask=flex.create_block_mask(window, None, 3, 16, 16, 32, 32))
    with pytest.raises(TypeError, match="block_mask: expected a BlockMask"):
        flex_attention(q, k, v, block_mask=window)
    with pytest.raises(TypeError, match="mask_mod _three: expected 4 parameters"):
        flex_attention(q, k, v, mask_mod=_three)
    with pytest.raises(ValueError, match="v: head dim 32 differs from q's 64"):
        flex_attention(q, k, v[..., :32].copy())
    with pytest.raises(TypeError, match="q: expected dtype"):
        flex_attention(q.astype(np.float32), k, v)
    many = np.zeros(2, np.float32)

    def four(score, b, h, q_idx, kv_idx, a, c, d, e):
        return score

    with pytest.raises(ValueError, match="score_mod: at most 3 bound arrays, got 4"):
        flex_attention(q, k, v, score_mod=flex.score_mod(four, *(4 * [many])))


def test_inputs_that_require_grad_go_through_the_backward_s_path_and_its_checks():
    """A tensor that requires grad (grad enabled) takes the autograd path (the backward with the mods,
    p14_flex.backward_for), whose forward checks the inputs as ever: on the CPU, the device's, by
    name, before anything runs; the same under torch.no_grad(). The GPU test checks the gradients."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    q, k, v = (torch.from_numpy(x) for x in random_qkv((1, 1, 16, 64), 16, seed=2, dtype=np.float16))
    with pytest.raises(TypeError, match="q: expected a CUDA torch tensor"):
        flex_attention(q, k.requires_grad_(), v, score_mod=flex.softcap(20.0))
    with torch.no_grad(), pytest.raises(TypeError, match="q: expected a CUDA torch tensor"):
        flex_attention(q, k, v)


def _three(b, h, q_idx):
    return True


# ---------------------------------------------------------------------------------------------
# On a GPU: torch CUDA tensors, both dtypes, the reference head dims
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("D, dtype, phase", [(64, "float16", None), (128, "bfloat16", None), (64, "float16", "07")])
def test_flex_attention_on_gpu(D, dtype, phase):
    """Each built-in on the GPU against the oracle, on the kernel flex_attention picks (phase 09 on
    Hopper) and on phase 07's; then its refusals, and the context alive after them."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    B, H, H_kv, S = 2, 4, 2, 1000
    gen = torch.Generator("cuda").manual_seed(D)
    q, k, v = (torch.randn((B, h, S, D), generator=gen, device="cuda").to(getattr(torch, dtype))
               for h in (H, H_kv, H_kv))
    ids = torch.randint(0, 4, (B, S), generator=gen, device="cuda").sort(dim=1).values.to(torch.int32)
    slopes = torch.tensor(flex.alibi_slopes(H), device="cuda")
    cases = [dict(score_mod=flex.softcap(20.0), mask_mod=flex.sliding_window(256)),
             dict(score_mod=flex.alibi(slopes), mask_mod=flex.document_mask(ids)),
             dict(mask_mod=flex.prefix_lm(100))]
    host = [x.float().cpu().numpy() for x in (q, k, v)]
    for case in cases:
        out, lse = flex_attention(q, k, v, return_lse=True, phase=phase, **case)
        ref, ref_lse = reference_flex(*host, **case)
        got = out.float().cpu().numpy()
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got, ref, atol=2e-2 if dtype == "bfloat16" else 4e-3, rtol=0)
        seen = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse.cpu().numpy()[seen], ref_lse[seen], atol=1e-3, rtol=1e-4)
    with pytest.raises(ValueError, match="score_mod alibi_mod: bound array 0 is a torch tensor on cpu"):
        flex_attention(q, k, v, score_mod=flex.alibi(slopes.cpu()))
    off = torch.empty(k.numel() + 8, dtype=k.dtype, device="cuda")[1:k.numel() + 1].view(k.shape)  # 2 bytes off
    off.copy_(k)
    with pytest.raises(ValueError, match="k: its address is 2 bytes past a 16-byte boundary"):
        flex_attention(q, off, v)
    assert torch.isfinite(flex_attention(q, k, v)).all()  # the context is alive
    # gradients through the mods: phase 11's backward with softcap and the window compiled in (GQA, tails)
    from flashcore_numba.reference import reference_flex_gradients

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = flex_attention(*leaves, phase=phase, **cases[0])
    dout = torch.randn(out.shape, generator=gen, device="cuda").to(out.dtype)
    out.backward(dout)
    ref = reference_flex_gradients(*host, dout.float().cpu().numpy(), **cases[0])
    for name, leaf, r in zip("qkv", leaves, ref):
        got = leaf.grad.float().cpu().numpy()
        assert not np.isnan(got).any(), name
        np.testing.assert_allclose(got, r, atol=(4e-2 if dtype == "bfloat16" else 1e-2) * np.abs(r).max() + 1e-3,
                                   rtol=0, err_msg=f"d{name}")
    with torch.no_grad():
        assert torch.equal(flex_attention(*leaves), flex_attention(q, k, v))
    # deterministic=True: the serial build, the same bits twice, and the gradients of the default's
    again = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    runs = [torch.autograd.grad(flex_attention(*again, phase=phase, deterministic=True, **cases[0]), again, dout)
            for _ in range(2)]
    for name, first, second, leaf in zip("qkv", *runs, leaves):
        assert torch.equal(first, second), f"d{name} differs between two deterministic runs"
        np.testing.assert_allclose(first.float().cpu().numpy(), leaf.grad.float().cpu().numpy(), rtol=0,
                                   atol=(2e-2 if dtype == "bfloat16" else 5e-3) * float(leaf.grad.abs().max()) + 1e-3)


# ---------------------------------------------------------------------------------------------
# The backward with the mods (phase 11's kernels, p14_flex.build_backward)
# ---------------------------------------------------------------------------------------------
BACKWARD_CASES = {
    "softcap + window": lambda B, H, S: dict(score_mod=flex.softcap(3.0), mask_mod=flex.sliding_window(9)),
    "ALiBi + documents, GQA": lambda B, H, S: dict(
        score_mod=flex.alibi(flex.alibi_slopes(H)),
        mask_mod=flex.document_mask(np.stack([np.repeat(np.arange(4), 12)[:S], np.repeat(np.arange(2), 30)[:S]]))),
    "prefix LM": lambda B, H, S: dict(mask_mod=flex.prefix_lm(5)),
}


@pytest.mark.slow  # about 45 s each in the simulator
@pytest.mark.parametrize("case, deterministic", [(case, False) for case in BACKWARD_CASES] + [
    ("softcap + window", True)])
def test_the_backward_with_mods_matches_the_oracle(case, deterministic):
    """dQ, dK and dV of phase 11's kernels with the mods compiled in against the float64 gradients
    with the same mods (reference_flex_gradients): tails on both lengths (S = 37 in tiles of 16),
    GQA, a mask that hides whole rows' keys; deterministic: the serial build (flex_attention's
    deterministic=True), dQ in two parts summed in order. Outputs poisoned with NaN (run_on_host);
    NaN never passes."""
    from flashcore_numba.phases import p11_backward as p11
    from flashcore_numba.reference import reference_flex_gradients

    B, H, H_kv, S, D, scale = 2, 4, 2, 37, 64, 0.2
    rng = np.random.default_rng(7)
    q = rng.uniform(-2, 2, (B, H, S, D)).astype(np.float16)
    k, v = (rng.uniform(-2, 2, (B, H_kv, S, D)).astype(np.float16) for _ in range(2))
    do = rng.uniform(-1, 1, (B, H, S, D)).astype(np.float16)
    mods = BACKWARD_CASES[case](B, H, S)
    o, lse = reference_flex(q, k, v, scale=scale, **mods)
    smod, mmod = mods.get("score_mod"), mods.get("mask_mod")
    bw = p14_flex.backward_for(D, "float16", smod, mmod)
    args = tuple(flex.device_arrays(m if m is not None else flex.Mod(None)) for m in (smod, mmod))
    block_m = bw.kv["STREAM_ROWS"]
    kinds = flex.kernel_kinds(None, mmod, B, H, S, S, block_m, bw.kv["OWN_ROWS"])
    rows = p14_flex.backward_rows(kinds, H // H_kv, S, block_m)
    got = p11.run_on_host(bw, q, k, v, o.astype(np.float16), do, lse.astype(np.float32), scale=scale,
                          mod_args=(*args, (rows, kinds)), deterministic=deterministic,
                          parts=2 if deterministic else None)
    ref = reference_flex_gradients(q, k, v, do, scale=scale, **mods)
    for name, x, r in zip(("dq", "dk", "dv"), got, ref):
        x = np.asarray(x, np.float64)
        assert not np.isnan(x).any(), name
        np.testing.assert_allclose(x, r, atol=1e-2 * np.abs(r).max() + 1e-3, rtol=0, err_msg=name)


def test_the_backward_visits_the_query_rows_the_block_mask_leaves():
    """backward_rows: per key block, from the first to the last query tile any head of the K/V head's
    group sees it in (the tiles between computed, not skipped), (0, 0) where none does, the last
    tile ending at seq_q; a block mask broadcast over heads gives one row of them."""
    E, P, F = p14_flex.EMPTY, p14_flex.PARTIAL, p14_flex.FULL
    kinds = np.array([[[[F, E, E], [P, E, E], [E, E, E]],    # head 0
                       [[E, E, E], [E, E, E], [P, E, F]],    # head 1 (same K/V head as 0)
                       [[E, E, E], [E, E, E], [E, E, E]],    # head 2
                       [[E, P, E], [E, E, E], [E, F, E]]]],  # head 3 (same K/V head as 2)
                     np.int8)
    rows = p14_flex.backward_rows(kinds, 2, 70, 32)
    assert rows.shape == (1, 2, 3, 2)
    assert rows[0, 0].tolist() == [[0, 70], [0, 0], [64, 70]]  # key block 0: tiles 0 .. 2 (head 0's, then 1's)
    assert rows[0, 1].tolist() == [[0, 0], [0, 70], [0, 0]]
    broadcast = p14_flex.backward_rows(kinds[:, :1], 4, 70, 32)
    assert broadcast.shape == (1, 1, 3, 2) and broadcast[0, 0].tolist() == [[0, 64], [0, 0], [0, 0]]


def test_the_backward_is_built_once_per_mods_code():
    """backward_for keeps one build per distinct code, as build_for does the forward's: a mod made anew
    from the same lambda each step shares it; another mod gets its own, and its own cache identity
    (each function's fingerprint in its role)."""
    def make():
        return flex.mask_mod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx < 5)

    first, again = (p14_flex.backward_for(64, "float16", None, make()) for _ in range(2))
    assert first is again
    other = p14_flex.backward_for(64, "float16", flex.softcap(2.0), make())
    assert other is not first and other.cache_id("11-kv") != first.cache_id("11-kv")
    assert first.cache_id("11-kv")[-3:-1] == ("none", "none")  # no score_mod, no grad


def test_a_backward_without_a_score_mods_grad_is_refused_by_name():
    doubled = flex.score_mod(lambda score, b, h, q_idx, kv_idx: score * 2)
    with pytest.raises(ValueError, match="score_mod: the backward needs its grad"):
        p14_flex.backward_for(64, "float16", doubled, None)


def test_gradients_through_a_score_mod_without_its_grad_are_refused_by_name():
    """Before anything runs: a score mod needs its derivative for the backward (flex.score_mod's grad=)."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    q = torch.zeros((1, 1, 4, 64), requires_grad=True)
    doubled = flex.score_mod(lambda score, b, h, q_idx, kv_idx: score * 2)
    with pytest.raises(ValueError, match="score_mod <lambda>: gradients through it need its derivative"):
        flex_attention(q, q, q, score_mod=doubled)
    with torch.no_grad(), pytest.raises(TypeError, match="q: expected a CUDA torch tensor"):
        flex_attention(q, q, q, score_mod=doubled)  # (without gradients: the inputs' own check)


@pytest.mark.gpu
@pytest.mark.parametrize("phase", [None, "07"])
def test_flex_attention_in_a_cuda_graph_and_from_a_new_thread_on_gpu(phase):
    """flex_attention runs on a plan (runtime/flex.py): captured in a CUDA graph and replayed on new
    data in the same buffers, right every time; called from a thread that has done no CUDA work, the
    same bits as from this one."""
    import threading

    torch = pytest.importorskip("torch", reason=NO_TORCH)
    B, H, S, D = 2, 4, 700, 64
    q, k, v = (torch.randn((B, H, S, D), device="cuda", dtype=torch.float16) for _ in range(3))
    window = flex.sliding_window(200)
    mods = dict(score_mod=flex.alibi(torch.tensor(flex.alibi_slopes(H), device="cuda")),
                block_mask=flex.create_block_mask(window, None, None, S, S))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch asks: the plan is made here
        flex_attention(q, k, v, phase=phase, **mods)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flex_attention(q, k, v, phase=phase, **mods)
    for replay in range(2):
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = reference_flex(*(x.float().cpu().numpy() for x in (q, k, v)), score_mod=mods["score_mod"],
                                mask_mod=window)
        np.testing.assert_allclose(out.float().cpu().numpy(), ref, atol=4e-3, rtol=0, err_msg=f"replay {replay}")
    here = flex_attention(q, k, v, phase=phase, **mods)
    there = []
    thread = threading.Thread(target=lambda: there.append(flex_attention(q, k, v, phase=phase, **mods)))
    thread.start()
    thread.join()
    torch.cuda.synchronize()
    assert torch.equal(there[0], here)


@pytest.mark.parametrize("mask, B, H, seq_q, seq_k", [
    (flex.sliding_window(40, 40), None, None, 70, 75),  # empty, partial and full tiles
    (flex.document_mask(np.stack([np.repeat(np.arange(3), 20)[:50], np.repeat(np.arange(2), 25)])), 2, None, 50, 50),
    (flex.mask_mod(lambda b, h, q_idx, kv_idx: (h + q_idx) % 4 != 0), None, 3, 40, 33),
])
def test_the_block_mask_on_the_device_is_the_hosts(mask, B, H, seq_q, seq_k):
    """create_block_mask(device=True) (a kernel with mask_mod compiled in, a block per tile) gives the
    host's kinds, tails and batch or head dependence included."""
    host = flex.create_block_mask(mask, B, H, seq_q, seq_k, 16, 16)
    device = flex.create_block_mask(mask, B, H, seq_q, seq_k, 16, 16, device=True)
    assert device.kinds.dtype == np.int8 and np.array_equal(device.kinds, host.kinds), (device.kinds, host.kinds)


@pytest.mark.gpu
def test_a_long_block_mask_on_gpu():
    """S = 8192 with a window of 1024 and documents per batch: the GPU's kinds are the host's, and the
    window leaves a band (the work of S = 32768 with the same window is 1/16 of causal's)."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    S = 8192
    window = flex.sliding_window(1024)
    assert np.array_equal(flex.create_block_mask(window, None, None, S, S, device=True).kinds,
                          flex.create_block_mask(window, None, None, S, S).kinds)
    ids = torch.randint(0, 6, (2, S), device="cuda").sort(dim=1).values.to(torch.int32)
    documents = flex.document_mask(ids)
    got = flex.create_block_mask(documents, 2, None, S, S, device=True)
    assert np.array_equal(got.kinds, flex.create_block_mask(flex.document_mask(ids.cpu().numpy()), 2, None, S, S).kinds)
    band = flex.create_block_mask(window, None, None, 32768, 32768, device=True)
    assert band.density < 1.5 * (1024 + 128) / 32768 + 1 / 256


# ---------------------------------------------------------------------------------------------
# `flashcore bench --flex` (measure/flex.py), with stand-ins on the CPU
# ---------------------------------------------------------------------------------------------
class StandInDevice:
    """What run_flex_benchmark asks of bench.TorchDevice, on the CPU: float32 torch tensors, fixed times."""

    kind, name, cc, torch_cuda = "torch", "Stand-in GPU", (8, 0), None

    def __init__(self):
        import torch

        self.torch = torch

    def inputs(self, problem, seed):
        g = self.torch.Generator().manual_seed(seed)
        kv = (problem.B, problem.heads_kv, problem.S_k, problem.D)
        return None, (self.torch.randn(problem.B, problem.H, problem.S_q, problem.D, generator=g) / 2,
                      self.torch.randn(kv, generator=g) / 2, self.torch.randn(kv, generator=g) / 2)

    def time_ms(self, launch, timing):
        launch()
        return [1.0, 2.0, 3.0]

    def release(self):
        pass

    # the call time's events (bench.call_times): the host's clock
    def synchronize(self):
        pass

    def event(self):
        return [0.0]

    def record(self, event):
        import time

        event[0] = time.perf_counter()

    def elapsed(self, start, end):
        return (end[0] - start[0]) * 1e3


@pytest.mark.parametrize("ignore_the_mask", [False, True])
def test_the_flex_benchmark_gates_each_case(monkeypatch, ignore_the_mask):
    """Every case's rows are gated by reference_flex with the case's mods before they are timed: a
    stand-in flex_attention that computes them passes, one that drops the mask fails where a mask
    hides keys; torch's FlexAttention is recorded unavailable with its reason (no triton here); the
    record is valid and its TFLOPS count the work the mask leaves."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    import flashcore_numba.api
    from flashcore_numba.measure import bench, records
    from flashcore_numba.measure import flex as flex_bench

    def stand_in(q, k, v, score_mod=None, block_mask=None):
        mask = None if ignore_the_mask or block_mask is None else block_mask.mask
        out, _ = reference_flex(*(x.numpy() for x in (q, k, v)), score_mod=score_mod, mask_mod=mask)
        return torch.from_numpy(out.astype(np.float16))

    def attention(q, k, v, causal=False):
        out, _ = reference_flex(*(x.numpy() for x in (q, k, v)), causal=causal)
        return torch.from_numpy(out.astype(np.float16))

    host_mask = flex.create_block_mask
    monkeypatch.setattr(flashcore_numba.api, "flex_attention", stand_in)
    monkeypatch.setattr(flashcore_numba.api, "attention", attention)
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, device=False: host_mask(*a))
    monkeypatch.setattr(flex_bench, "WINDOW", 24)
    problem = bench.Problem(1, 2, 96, 96, 64)
    record = flex_bench.run_flex_benchmark(problem, device=StandInDevice(), command=["x"], seed=3)
    assert records.validate_record(record) == []
    rows = {r["name"]: r for r in record["results"]}
    assert list(rows) == [name for case in flex_bench.CASES for name in
                          (f"14 {case}", *(["attention causal=True"] * (case == "causal_mask")),
                           f"flex_attention {case}")]
    for case in flex_bench.CASES:
        assert not rows[f"flex_attention {case}"]["available"] and rows[f"flex_attention {case}"]["reason"]
        masked = case in ("sliding_window", "documents", "causal_mask")
        assert rows[f"14 {case}"]["correct"] is (not (ignore_the_mask and masked)), rows[f"14 {case}"]["message"]
    assert rows["attention causal=True"]["correct"]
    if not ignore_the_mask:  # the causal mask keeps (S + 1) / 2S of the pairs: its TFLOPS count those
        kept = (96 + 1) / (2 * 96)
        assert rows["14 causal_mask"]["tflops"] == pytest.approx(problem.flops * kept / 2e-3 / 1e12)
        assert "call" not in rows["14 causal_mask"]  # (not asked for)
        # --calls: each timed row also gets its call time, back to back (median, p99, the host's time)
        record = flex_bench.run_flex_benchmark(problem, cases=("causal_mask",), timing=bench.Timing(calls=1),
                                               device=StandInDevice(), command=["x"], seed=3)
        assert records.validate_record(record) == []
        call = {r["name"]: r for r in record["results"]}["14 causal_mask"]["call"]
        assert call["median_ms"] > 0 and call["p99_ms"] >= call["median_ms"] and call["host_median_us"] > 0


@pytest.mark.parametrize("ignore_the_mask", [False, True])
def test_the_flex_benchmarks_backward_gates_each_gradient(monkeypatch, ignore_the_mask):
    """--backward: each case's backward row is timed only after dq, dk and dv of batch 0 (whole GQA
    groups) pass reference_flex_gradients with the case's mods: a stand-in whose backward is the
    oracle's passes, one whose backward drops the mask fails where the mask hides keys; the record is
    valid, the rows follow their case, and their TFLOPS count 2.5 x the work the mask leaves."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    import flashcore_numba.api
    from flashcore_numba.measure import bench, records
    from flashcore_numba.measure import flex as flex_bench
    from flashcore_numba.reference import reference_flex_gradients

    class StandIn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, score_mod, mask_mod):
            ctx.save_for_backward(q, k, v)
            ctx.mods = score_mod, mask_mod
            out, _ = reference_flex(*(x.numpy() for x in (q, k, v)), score_mod=score_mod, mask_mod=mask_mod)
            return torch.from_numpy(out.astype(np.float32))

        @staticmethod
        def backward(ctx, do):
            score_mod, mask_mod = ctx.mods
            mask_mod = None if ignore_the_mask else mask_mod
            grads = reference_flex_gradients(*(x.detach().numpy() for x in ctx.saved_tensors), do.numpy(),
                                             score_mod=score_mod, mask_mod=mask_mod)
            return (*(torch.from_numpy(g.astype(np.float32)) for g in grads), None, None)

    def stand_in(q, k, v, score_mod=None, block_mask=None):
        return StandIn.apply(q, k, v, score_mod, None if block_mask is None else block_mask.mask)

    host_mask = flex.create_block_mask
    monkeypatch.setattr(flashcore_numba.api, "flex_attention", stand_in)
    monkeypatch.setattr(flex, "create_block_mask", lambda *a, device=False: host_mask(*a))
    monkeypatch.setattr(flex_bench, "WINDOW", 24)
    problem = bench.Problem(1, 4, 80, 80, 64, H_kv=2)
    cases = ("softcap", "sliding_window")
    record = flex_bench.run_flex_benchmark(problem, cases=cases, device=StandInDevice(), command=["x"], seed=5,
                                           backward=True)
    assert records.validate_record(record) == []
    rows = {r["name"]: r for r in record["results"]}
    assert list(rows) == [name for case in cases for name in
                          (f"14 {case}", f"flex_attention {case}", f"14 {case} backward", f"flex_attention {case} backward")]
    assert not rows["flex_attention softcap backward"]["available"] and rows["flex_attention softcap backward"]["reason"]
    assert rows["14 softcap backward"]["correct"], rows["14 softcap backward"]["message"]
    window = rows["14 sliding_window backward"]
    assert window["correct"] is not ignore_the_mask, window["message"]
    if not ignore_the_mask:
        kept = flex_bench.kept_share(flex.sliding_window(24), 80, 80)
        assert window["tflops"] == pytest.approx(2.5 * problem.flops * kept / 2e-3 / 1e12)
    with pytest.raises(ValueError, match="backward: S up to 8192"):
        flex_bench.run_flex_benchmark(bench.Problem(1, 1, 16384, 16384, 64), device=StandInDevice(), backward=True)


@pytest.mark.parametrize("argv, says", [
    (["--causal"], "--flex: one problem, its cases' own masks; drop"),
    (["--seq-k", "100"], "--flex: the cases' masks are of S_q = S_k; drop --seq-k"),
])
def test_bench_flex_refuses_what_it_cannot_run(monkeypatch, capsys, argv, says):
    """Its own arguments' mistakes, named (as if on a GPU: the simulator's refusal comes first otherwise)."""
    import flashcore_numba.cli as cli

    monkeypatch.setattr(cli, "kernel_target", lambda: "gpu")
    assert cli.main(["bench", "--flex", "--shape", "1,2,64,64", *argv]) != 0
    assert says in capsys.readouterr().err


def test_a_second_call_copies_nothing_to_the_device(monkeypatch):
    """The block mask's lists and a mod's NumPy arrays go to the device on the first call with them and
    are kept: a later call with the same block mask and mods copies nothing (a copy from the host's
    memory would wait for the GPU's queued work)."""
    from numba import cuda

    import flashcore_numba.api

    monkeypatch.setattr(flashcore_numba.api, "_KEPT", {})  # nothing kept from the tests before
    q, k, v = (cuda.to_device(x) for x in random_qkv((1, 1, 20, 64), 20, seed=8, dtype=np.float16))
    blocks = flex.create_block_mask(flex.sliding_window(8), None, None, 20, 20, 32, 32)
    cap = flex.softcap(5.0)
    first = flex_attention(q, k, v, score_mod=cap, block_mask=blocks).copy_to_host()
    copies = []
    to_device = cuda.to_device
    monkeypatch.setattr(cuda, "to_device", lambda *a, **kw: copies.append(a) or to_device(*a, **kw))
    again = flex_attention(q, k, v, score_mod=cap, block_mask=blocks).copy_to_host()
    assert copies == [] and np.array_equal(first, again)
    flex_attention(q, k, v, score_mod=flex.softcap(5.0), block_mask=blocks)  # a new mod: its array, once
    assert len(copies) == 1

    def no_arrays(score, b, h, q_idx, kv_idx):
        return score * 0.5

    for _ in range(3):  # a plain function: a new mod each call, without arrays: the stand-in array, once
        flex_attention(q, k, v, score_mod=no_arrays, block_mask=blocks)
    assert len(copies) == 2
    for _ in range(3):  # no mask at all: the all-full lists (three arrays), once
        flex_attention(q, k, v, score_mod=cap)
    assert len(copies) == 5


def test_mods_of_the_same_code_share_a_build():
    """A lambda written in a loop is a new function each time with the same code: one build serves
    them all (no compile per call); other code, or a mod that reads an array, another build."""
    made = [p14_flex.build_for(64, "float16", None, flex.mask_mod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx))
            for _ in range(3)]
    assert made[0] is made[1] is made[2]
    other = p14_flex.build_for(64, "float16", None, flex.mask_mod(lambda b, h, q_idx, kv_idx: q_idx > kv_idx))
    assert other is not made[0]


def test_a_mods_fingerprint_follows_its_code_and_the_globals_it_reads():
    """The kernel cache keys phase 14's kernel by its mods' fingerprints (arch/cache.function_fingerprint):
    the same in every process for the same code; another constant, or another value of a global number
    it reads, another fingerprint; a mod that reads a global array (which could change under it) none,
    so its kernel is compiled in each process and never loaded stale."""
    import subprocess
    import sys

    from flashcore_numba.arch.cache import function_fingerprint

    script = ("from flashcore_numba import flex; from flashcore_numba.arch.cache import function_fingerprint as f; "
              "print(f(flex.alibi_mod), f(flex.document_causal_mod))")
    there = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    assert there == [function_fingerprint(flex.alibi_mod), function_fingerprint(flex.document_causal_mod)]
    # every built-in has one: alibi_mod's `np.float32` names float32, an attribute, not the Numba type of
    # that name its module holds as a global (counted as one, it had none, and compiled in every process)
    for mod in (flex.causal_mod, flex.sliding_window_mod, flex.prefix_lm_mod, flex.document_causal_mod,
                flex.document_mod, flex.softcap_mod, flex.alibi_mod):
        assert function_fingerprint(mod) is not None, mod.__name__
    global LIMIT

    def under(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= LIMIT

    def under_three(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= 3

    LIMIT = 3
    first = function_fingerprint(under)
    LIMIT = 4
    assert function_fingerprint(under) != first != function_fingerprint(under_three) is not None
    table = np.zeros(4)

    def reads_an_array(b, h, q_idx, kv_idx):
        return table[h] > 0

    assert function_fingerprint(reads_an_array) is None
    assert p14_flex.cache_identity(64, "float16", None, flex.mask_mod(reads_an_array)) == ()


LIMIT = 3


def test_the_report_reads_the_flex_records():
    """`flashcore report` turns docs/bench/flex/ into docs/performance.md's table and phase 14's "Measured
    effect": per case phase 14's TFLOPS over FlexAttention's in the same record, and causal as a mask_mod
    beside attention(causal=True); the phase's docstring holds what the committed records say."""
    import inspect
    from pathlib import Path

    from flashcore_numba.measure import report
    from flashcore_numba.measure.records import default_records_dir, load_records
    from flashcore_numba.phases import p14_flex

    found = load_records(default_records_dir() / "flex")
    assert found, "no flex record is committed"
    table = "\n".join(report.flex_table(found, Path("docs")))
    for record in found:
        timed = {r["name"]: r for r in record["results"] if r.get("tflops")}
        for case, mine, theirs in report._flex_pairs(record):
            assert mine is timed.get(f"14 {case}") and theirs is timed.get(f"flex_attention {case}")
            if mine and theirs:
                assert f"| {case} | {mine['median_ms']:.3f} |" in table
                assert f"{mine['tflops'] / theirs['tflops']:.2f}× |" in table
        assert Path(record["_path"]).name in table
    measured = report.flex_measured_lines(found)
    assert measured != [report.DOCSTRING_INDENT + report.NOT_MEASURED]
    assert all(line.strip() in inspect.getdoc(p14_flex) for line in measured), "run `flashcore report`"
    assert report.flex_measured_lines([]) == [report.DOCSTRING_INDENT + report.NOT_MEASURED]
    # the README's headline: a row per case, each head dim's figures side by side, FlexAttention's speed
    # over phase 14's from the same record; a record at another S is not in it
    chosen = report.flex_headline_records(found)
    assert chosen and all(r["config"]["S_q"] == report.FLEX_HEADLINE_S for r in chosen)
    rows = report.flex_rows(found, Path("."))
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for case, _, _ in report._flex_pairs(chosen[-1]):
        row = next(row for row in rows if f"| {case}, B=16 H=16 S={report.FLEX_HEADLINE_S} fp16" in row)
        ratios = [f"{theirs['median_ms'] / mine['median_ms']:.2f}×" for r in chosen
                  for c, mine, theirs in report._flex_pairs(r) if c == case]
        assert " / ".join(ratios) + " FlexAttention |" in row
        assert row.split("|")[2] in readme, "run `flashcore report`"
    assert report.flex_rows([], Path(".")) == []


def test_the_flex_benchmark_checks_the_edges_of_a_long_sequence():
    """Past S = 8192 the benchmark's oracle checks the first and last rows (the long window of issue
    #77 is S = 32768), and the share of pairs a mask keeps is counted a chunk of rows at a time, the
    same as the whole matrix's mean."""
    from flashcore_numba.measure import flex as flex_bench

    assert flex_bench.oracle_rows(300).tolist() == list(range(300))
    edges = flex_bench.oracle_rows(32768)
    assert len(edges) == 2 * flex_bench.ORACLE_EDGE_ROWS and edges[0] == 0 and edges[-1] == 32767
    window = flex.sliding_window(24)
    assert flex_bench.kept_share(window, 100, 100, chunk=7) == pytest.approx(
        flex.mask_matrix(window, 0, 0, 100, 100).mean())
    assert flex_bench.kept_share(None, 5, 5) == 1.0


def test_bench_cases_belong_to_flex(capsys):
    """--cases names --flex's cases, and comes only with --flex."""
    import flashcore_numba.cli as cli

    assert cli._flex_cases("sliding_window, causal_mask") == ("sliding_window", "causal_mask")
    with pytest.raises(Exception, match="expected some of sliding_window"):
        cli._flex_cases("sliding_window,nope")
    assert cli.main(["bench", "--cases", "softcap"]) != 0
    assert "--cases: the cases of --flex; only with --flex" in capsys.readouterr().err
