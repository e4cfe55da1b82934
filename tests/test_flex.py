"""score_mod and mask_mod (flashcore_numba/flex.py): the checks of a mod, the built-ins against their
definitions, the block mask against every element, and the float64 oracle with mods
(reference.reference_flex). Host code only: no kernel runs here."""

import math

import numpy as np
import pytest

from flashcore_numba import flex
from flashcore_numba.reference import (
    random_qkv,
    reference_attention,
    reference_flex,
    reference_lse,
    visible_mask,
)


def brute(mask_fn, seq_q, seq_k, b=0, h=0):
    """A mask's matrix one element at a time, by a plain double loop."""
    return np.array([[bool(mask_fn(b, h, i, j)) for j in range(seq_k)] for i in range(seq_q)])


# ---------------------------------------------------------------------------------------------
# A mod is checked before anything uses it
# ---------------------------------------------------------------------------------------------
def test_a_mod_with_the_wrong_parameters_is_named():
    def three(b, h, q_idx):
        return True

    with pytest.raises(TypeError, match=r"mask_mod three: expected 4 parameters \(b, h, q_idx, kv_idx\), got 3"):
        flex.mask_mod(three)

    def bias(score, b, h, q_idx, kv_idx, table):
        return score + table[h]

    with pytest.raises(TypeError, match="score_mod bias: expected 5 parameters .* got 6.* its last 1 take arrays: "
                                        r"bind them, flex.score_mod\(bias, array, ...\)"):
        flex.score_mod(bias)  # the table is not bound
    with pytest.raises(TypeError, match=r"score_mod bias: expected 7 parameters \(.* and 2 bound arrays\), got 6"):
        flex.score_mod(bias, np.zeros(2), np.zeros(2))
    with pytest.raises(TypeError, match=r"score_mod bias: bound argument 0 \(table\) must be an array"):
        flex.score_mod(bias, 0.5)
    with pytest.raises(TypeError, match="expected plain positional parameters"):
        flex.mask_mod(lambda *args: True)
    with pytest.raises(TypeError, match="mask_mod: expected a function"):
        flex.mask_mod(42)


def test_a_mod_that_returns_the_wrong_kind_of_value_is_named():
    def rows(b, h, q_idx, kv_idx):
        return np.ones(3, bool)

    with pytest.raises(ValueError, match=r"mask_mod rows: expected a scalar, got a value of shape \(3,\)"):
        flex.mask_mod(rows)

    def number(b, h, q_idx, kv_idx):
        return 1

    with pytest.raises(ValueError, match="mask_mod number: expected a bool"):
        flex.mask_mod(number)

    def words(score, b, h, q_idx, kv_idx):
        return "score"

    with pytest.raises(ValueError, match="score_mod words: expected a number"):
        flex.score_mod(words)

    def fails(score, b, h, q_idx, kv_idx, table):
        return score + table[q_idx + 5]

    with pytest.raises(ValueError, match="score_mod fails: calling it on sample indices .* raised IndexError"):
        flex.score_mod(fails, np.zeros(2, np.float32))


# ---------------------------------------------------------------------------------------------
# The built-ins, element by element against their definitions
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("left, right", [(3, 0), (0, 0), (2, 5)])
def test_sliding_window_is_the_band_it_names(left, right):
    got = flex.mask_matrix(flex.sliding_window(left, right), 0, 0, 13, 17)
    expected = brute(lambda b, h, i, j: i - left <= j <= i + right, 13, 17)
    np.testing.assert_array_equal(got, expected)


def test_prefix_lm_causal_and_documents():
    np.testing.assert_array_equal(flex.mask_matrix(flex.prefix_lm(4), 0, 0, 11, 11),
                                  brute(lambda b, h, i, j: j < 4 or j <= i, 11, 11))
    np.testing.assert_array_equal(flex.mask_matrix(flex.causal_mask(), 0, 0, 9, 9), visible_mask(9, 9, True))
    ids = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2, 3]], np.int32)
    for b in (0, 1):
        np.testing.assert_array_equal(flex.mask_matrix(flex.document_mask(ids), b, 0, 9, 9),
                                      brute(lambda _b, h, i, j, b=b: ids[b, i] == ids[b, j] and j <= i, 9, 9))
        np.testing.assert_array_equal(flex.mask_matrix(flex.document_mask(ids, causal=False), b, 0, 9, 9),
                                      brute(lambda _b, h, i, j, b=b: ids[b, i] == ids[b, j], 9, 9))


def test_built_ins_refuse_bad_arguments_by_name():
    with pytest.raises(ValueError, match="sliding_window: left must be"):
        flex.sliding_window(-1)
    with pytest.raises(ValueError, match="softcap: cap must be"):
        flex.softcap(0)
    with pytest.raises(ValueError, match="alibi: slopes must be one number per query head"):
        flex.alibi(np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="document_mask: doc_ids must be integers"):
        flex.document_mask(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="prefix_lm: prefix_len must be"):
        flex.prefix_lm(2.5)


def test_a_mod_written_for_scalars_is_evaluated_element_by_element():
    """`if` and `and` do not broadcast over NumPy arrays: evaluate falls back to one call per element,
    with the same answer as the vectorized form."""
    def scalar_window(b, h, q_idx, kv_idx):
        if q_idx < kv_idx:
            return False
        return q_idx - kv_idx <= 2 and True

    np.testing.assert_array_equal(flex.mask_matrix(flex.mask_mod(scalar_window), 0, 0, 7, 7),
                                  flex.mask_matrix(flex.sliding_window(2), 0, 0, 7, 7))


def test_a_mod_with_maths_functions_is_evaluated_on_whole_arrays(monkeypatch):
    """math.tanh takes no arrays: evaluate calls a mod that uses math's functions with NumPy's in their
    place, in one call (the oracle of a soft-cap at S = 1000 once took minutes element by element),
    and the mod's own function is left as it was."""
    calls = []
    real = flex.softcap_mod

    def counting(score, b, h, q_idx, kv_idx, capped):
        calls.append(np.shape(score))
        return capped[0] * math.tanh(score / capped[0])

    counting.__globals__["math"] = math
    mod = flex.score_mod(counting, np.array([5.0], np.float32))
    calls.clear()
    scores = np.linspace(-40, 40, 12).reshape(3, 4)
    got = flex.evaluate(mod, scores, 0, 0, np.arange(3)[:, None], np.arange(4)[None])
    np.testing.assert_allclose(got, 5 * np.tanh(scores / 5), rtol=1e-6)
    assert calls == [(3, 4)]  # once, on the whole grid
    assert counting(3.0, 0, 0, 0, 0, np.array([5.0])) == pytest.approx(5 * math.tanh(0.6))  # math is math again
    assert flex.softcap_mod is real


# ---------------------------------------------------------------------------------------------
# The block mask: empty, partial and full tiles
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask, seq_q, seq_k", [
    (flex.causal_mask(), 100, 100),
    (flex.sliding_window(20), 130, 130),
    (flex.prefix_lm(40), 70, 70),
    (flex.document_mask(np.repeat(np.arange(4, dtype=np.int32), [30, 2, 50, 15])), 97, 97),
    (flex.mask_mod(lambda b, h, i, j: (i + j) % 3 == 0), 40, 50),  # partial everywhere
], ids=["causal", "window", "prefix", "documents", "checkerboard"])
def test_each_tile_is_classified_by_its_elements(mask, seq_q, seq_k):
    """Tiles of 16 x 32 against the element matrix: a tile is full when every row and key it has (the
    edge tiles have fewer) is visible, empty when none is, else partial."""
    bm = flex.create_block_mask(mask, None, None, seq_q, seq_k, block_m=16, block_n=32)
    seen = flex.mask_matrix(mask, 0, 0, seq_q, seq_k)
    assert bm.kinds.shape == (1, 1, math.ceil(seq_q / 16), math.ceil(seq_k / 32))
    for m, n in np.ndindex(bm.kinds.shape[2:]):
        tile = seen[16 * m:16 * (m + 1), 32 * n:32 * (n + 1)]
        expected = flex.FULL if tile.all() else flex.PARTIAL if tile.any() else flex.EMPTY
        assert bm.kinds[0, 0, m, n] == expected, (m, n)
    visited = [n for m in range(bm.kinds.shape[2]) for n in bm.kv_blocks(3, 5, m)]  # b, h broadcast
    assert len(visited) == int(np.sum(bm.kinds != flex.EMPTY)) and 0 < bm.density <= 1


def test_a_block_mask_per_batch_and_head():
    """A document mask of two batches differs by batch; a mask by head (every other head sees
    nothing) by head: B and H given, one entry each."""
    ids = np.array([[0] * 64 + [1] * 64, [0] * 128], np.int32)
    bm = flex.create_block_mask(flex.document_mask(ids, causal=False), 2, None, 128, 128, 64, 64)
    assert bm.kinds.shape == (2, 1, 2, 2)
    np.testing.assert_array_equal(bm.kinds[0, 0], [[flex.FULL, flex.EMPTY], [flex.EMPTY, flex.FULL]])
    np.testing.assert_array_equal(bm.kinds[1, 0], np.full((2, 2), flex.FULL))
    by_head = flex.create_block_mask(lambda b, h, i, j: h % 2 == 0, None, 4, 64, 64, 64, 64)
    assert [int(by_head.kinds[0, h, 0, 0]) for h in range(4)] == [flex.FULL, flex.EMPTY] * 2
    with pytest.raises(ValueError, match="create_block_mask: block_m must be a whole number >= 1"):
        flex.create_block_mask(flex.causal_mask(), None, None, 8, 8, block_m=0)


def test_a_long_window_leaves_a_band_of_tiles():
    """A window of 1024 keys (the issue's long-context case, here at S = 4096): at 128 x 128 tiles a
    query block visits at most 9 key blocks (8 of the window before it, and its own diagonal one),
    however long the sequence."""
    bm = flex.create_block_mask(flex.sliding_window(1024), None, None, 4096, 4096)
    assert max(len(bm.kv_blocks(0, 0, m)) for m in range(bm.kinds.shape[2])) == 9
    causal = flex.create_block_mask(flex.causal_mask(), None, None, 4096, 4096)
    assert bm.density < causal.density


# ---------------------------------------------------------------------------------------------
# The oracle with mods
# ---------------------------------------------------------------------------------------------
def test_the_oracle_without_mods_is_attention():
    q, k, v = random_qkv((2, 4, 19, 32), 23, heads_kv=2, seed=1, dtype=np.float64)
    out, lse = reference_flex(q, k, v, causal=True)
    np.testing.assert_allclose(out, reference_attention(q, k, v, causal=True), atol=1e-12)
    np.testing.assert_allclose(lse, reference_lse(q, k, causal=True), atol=1e-12)
    by_mod, _ = reference_flex(q[:, :, :19], k[:, :, :19], v[:, :, :19], mask_mod=flex.causal_mask())
    np.testing.assert_allclose(by_mod, reference_attention(q, k[:, :, :19], v[:, :, :19], causal=True), atol=1e-12)


def test_the_oracle_applies_score_mods_to_the_scaled_scores():
    """softcap and ALiBi against the same formulas written out on the score matrix."""
    q, k, v = random_qkv((1, 2, 9, 16), 9, seed=2, dtype=np.float64, scale=3.0)
    scale = 0.25
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    slopes = flex.alibi_slopes(2)
    i, j = np.arange(9)[:, None], np.arange(9)[None, :]
    for mod, changed in ((flex.softcap(2.0), 2.0 * np.tanh(s / 2.0)),
                         (flex.alibi(slopes), s + slopes[None, :, None, None].astype(np.float64) * (j - i))):
        p = np.exp(changed - changed.max(-1, keepdims=True))
        expected = (p / p.sum(-1, keepdims=True)) @ v
        out, _ = reference_flex(q, k, v, score_mod=mod, scale=scale)
        np.testing.assert_allclose(out, expected, atol=1e-6)


def test_rows_a_mask_hides_every_key_from_give_zeros():
    q, k, v = random_qkv((1, 1, 6, 8), 6, seed=3, dtype=np.float64)
    out, lse = reference_flex(q, k, v, mask_mod=flex.mask_mod(lambda b, h, i, j: i >= 3))
    assert not out[0, 0, :3].any() and np.isneginf(lse[0, 0, :3]).all()
    np.testing.assert_allclose(out[0, 0, 3:], reference_attention(q, k, v)[0, 0, 3:], atol=1e-12)


def test_the_oracle_of_some_rows_is_those_rows_of_the_whole():
    """reference_flex(rows=...) (the flex benchmark's oracle past S = 8192, where the whole float64
    scores would not fit) gives exactly those rows of the whole answer, causal and mods included."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 40, 16)) for _ in range(3))
    rows = np.array([0, 7, 39, 20])
    for kw in (dict(mask_mod=flex.sliding_window(5)), dict(score_mod=flex.softcap(2.0), causal=True)):
        whole, whole_lse = reference_flex(q, k, v, **kw)
        some, some_lse = reference_flex(q, k, v, rows=rows, **kw)
        np.testing.assert_array_equal(some, whole[:, :, rows])
        np.testing.assert_array_equal(some_lse, whole_lse[:, :, rows])
    assert flex.mask_matrix(flex.causal_mask(), 0, 0, 40, 40, rows).shape == (4, 40)


# ---------------------------------------------------------------------------------------------
# Gradients through the mods: the oracle of the backward
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mods", [
    dict(score_mod=flex.softcap(1.5), mask_mod=flex.sliding_window(4)),
    dict(score_mod=flex.alibi(flex.alibi_slopes(4)), mask_mod=flex.document_mask(np.repeat(np.arange(3), 4)[:11])),
    dict(mask_mod=flex.prefix_lm(3)),
], ids=["softcap+window", "alibi+documents", "prefix"])
def test_the_gradient_oracle_is_the_derivative_of_the_output(mods):
    """reference_flex_gradients against central differences of reference_flex's output (float64),
    GQA and a mask that hides whole rows of keys included: so the oracle's chain rule and the
    built-ins' grads (softcap's 1 - tanh², a bias's 1) are both right."""
    from flashcore_numba.reference import reference_flex_gradients

    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 4, 11, 8)) * 2
    k, v = (rng.standard_normal((1, 2, 11, 8)) * 2 for _ in range(2))
    do = rng.standard_normal((1, 4, 11, 8))
    grads = reference_flex_gradients(q, k, v, do, scale=0.5, **mods)
    eps = 1e-6
    for x, grad in zip((q, k, v), grads):
        for index in [tuple(rng.integers(0, n) for n in x.shape) for _ in range(6)]:
            plus, minus = x.copy(), x.copy()
            plus[index] += eps
            minus[index] -= eps
            args = [plus if a is x else a for a in (q, k, v)], [minus if a is x else a for a in (q, k, v)]
            f = [np.sum(reference_flex(*a, scale=0.5, **mods)[0] * do) for a in args]
            assert grad[index] == pytest.approx((f[0] - f[1]) / (2 * eps), abs=1e-6, rel=1e-5), index


def test_a_score_mod_without_a_grad_has_no_gradients():
    from flashcore_numba.reference import reference_flex_gradients

    q = np.zeros((1, 1, 2, 8))
    doubled = flex.score_mod(lambda score, b, h, q_idx, kv_idx: score * 2)
    with pytest.raises(ValueError, match="score_mod <lambda>: no grad given"):
        reference_flex_gradients(q, q, q, q, score_mod=doubled)
    with_grad = flex.score_mod(lambda score, b, h, q_idx, kv_idx: score * 2,
                               grad=lambda score, b, h, q_idx, kv_idx: 2.0)
    assert with_grad.grad(0.0, 0, 0, 0, 0) == 2.0
    with pytest.raises(TypeError, match=r"score_mod <lambda>: expected 5 parameters"):
        flex.score_mod(lambda score, b, h, q_idx, kv_idx: score, grad=lambda score: 1.0)
