"""Writes p10v7.py beside this file: phase 10's module with the softmax of a row tile's upper
eight rows left out where they are all padding.

At a decode step a K/V head's packed rows are group * S_q: 4 at H_q/H_kv = 32/8, S_q = 1. The
mma.sync tile has 16 rows; each lane runs the softmax of rows g and g + 8 (its `a` and `b`
values). Where the tile has at most 8 real rows (a uniform test, once a block), every `b` value
is padding: its row max, its two shuffles, its exp2s (16 a tile, on the multi-function unit),
its l_i and its rescale are work whose result no merge reads. Here they are skipped: the `b`
halves of P are packed as 0, so acc's `b` rows stay 0 and l_b 0 (lse -inf, as a row with no
key). The tensor-core work is unchanged (an m16 tile either way); so is every other shape."""
from pathlib import Path

here = Path(__file__).parent
src = (here / "../../../flashcore_numba/phases/p10_split_keys.py").read_text()
HEADER = [
    ("from ..arch import", "from flashcore_numba.arch import"),
    ("from ..arch.sim import", "from flashcore_numba.arch.sim import"),
    ("from .common import", "from flashcore_numba.phases.common import"),
    ("from .p07_mma_sync import", "from flashcore_numba.phases.p07_mma_sync import"),
]
HALF = [
    ("""        k_end_b = key_end(q_b, seq_q, seq_k, causal)
""", """        k_end_b = key_end(q_b, seq_q, seq_k, causal)
        half = rows - row0 <= 8  # rows g + 8 of the tile all padding: their softmax is skipped
"""),
    ("""            for j in range(NT):
                m_ij_a = max(m_ij_a, max(s[j, 0], s[j, 1]))
                m_ij_b = max(m_ij_b, max(s[j, 2], s[j, 3]))
            m_ij_a = max(m_ij_a, cuda.shfl_xor_sync(FULL_MASK, m_ij_a, 1))
            m_ij_a = max(m_ij_a, cuda.shfl_xor_sync(FULL_MASK, m_ij_a, 2))
            m_ij_b = max(m_ij_b, cuda.shfl_xor_sync(FULL_MASK, m_ij_b, 1))
            m_ij_b = max(m_ij_b, cuda.shfl_xor_sync(FULL_MASK, m_ij_b, 2))
""", """            for j in range(NT):
                m_ij_a = max(m_ij_a, max(s[j, 0], s[j, 1]))
            m_ij_a = max(m_ij_a, cuda.shfl_xor_sync(FULL_MASK, m_ij_a, 1))
            m_ij_a = max(m_ij_a, cuda.shfl_xor_sync(FULL_MASK, m_ij_a, 2))
            if not half:
                for j in range(NT):
                    m_ij_b = max(m_ij_b, max(s[j, 2], s[j, 3]))
                m_ij_b = max(m_ij_b, cuda.shfl_xor_sync(FULL_MASK, m_ij_b, 1))
                m_ij_b = max(m_ij_b, cuda.shfl_xor_sync(FULL_MASK, m_ij_b, 2))
"""),
    ("""                m_a, m_ref_a, alpha_a = softmax_rescale(m_a, m_ij_a * scale)
                m_b, m_ref_b, alpha_b = softmax_rescale(m_b, m_ij_b * scale)
                l_a *= alpha_a
                l_b *= alpha_b
                for j in range(NO):
                    acc[j, 0] *= alpha_a
                    acc[j, 1] *= alpha_a
                    acc[j, 2] *= alpha_b
                    acc[j, 3] *= alpha_b
            for j in range(NT):
                s[j, 0] = exp2(cuda.fma(s[j, 0], scale, -m_ref_a))
                s[j, 1] = exp2(cuda.fma(s[j, 1], scale, -m_ref_a))
                s[j, 2] = exp2(cuda.fma(s[j, 2], scale, -m_ref_b))
                s[j, 3] = exp2(cuda.fma(s[j, 3], scale, -m_ref_b))
                l_a += s[j, 0] + s[j, 1]
                l_b += s[j, 2] + s[j, 3]
            for kk in range(KP):
                p_frag[kk, 0] = pack(s[2 * kk, 0], s[2 * kk, 1])
                p_frag[kk, 1] = pack(s[2 * kk, 2], s[2 * kk, 3])
                p_frag[kk, 2] = pack(s[2 * kk + 1, 0], s[2 * kk + 1, 1])
                p_frag[kk, 3] = pack(s[2 * kk + 1, 2], s[2 * kk + 1, 3])
""", """                m_a, m_ref_a, alpha_a = softmax_rescale(m_a, m_ij_a * scale)
                l_a *= alpha_a
                for j in range(NO):
                    acc[j, 0] *= alpha_a
                    acc[j, 1] *= alpha_a
                if not half:
                    m_b, m_ref_b, alpha_b = softmax_rescale(m_b, m_ij_b * scale)
                    l_b *= alpha_b
                    for j in range(NO):
                        acc[j, 2] *= alpha_b
                        acc[j, 3] *= alpha_b
            for j in range(NT):
                s[j, 0] = exp2(cuda.fma(s[j, 0], scale, -m_ref_a))
                s[j, 1] = exp2(cuda.fma(s[j, 1], scale, -m_ref_a))
                l_a += s[j, 0] + s[j, 1]
            if half:
                for kk in range(KP):
                    p_frag[kk, 0] = pack(s[2 * kk, 0], s[2 * kk, 1])
                    p_frag[kk, 1] = uint32(0)
                    p_frag[kk, 2] = pack(s[2 * kk + 1, 0], s[2 * kk + 1, 1])
                    p_frag[kk, 3] = uint32(0)
            else:
                for j in range(NT):
                    s[j, 2] = exp2(cuda.fma(s[j, 2], scale, -m_ref_b))
                    s[j, 3] = exp2(cuda.fma(s[j, 3], scale, -m_ref_b))
                    l_b += s[j, 2] + s[j, 3]
                for kk in range(KP):
                    p_frag[kk, 0] = pack(s[2 * kk, 0], s[2 * kk, 1])
                    p_frag[kk, 1] = pack(s[2 * kk, 2], s[2 * kk, 3])
                    p_frag[kk, 2] = pack(s[2 * kk + 1, 0], s[2 * kk + 1, 1])
                    p_frag[kk, 3] = pack(s[2 * kk + 1, 2], s[2 * kk + 1, 3])
"""),
]


def write(name, edits, source=src):
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    (here / f"{name}.py").write_text(source)
    return source


if __name__ == "__main__":
    write("p10v7", HEADER + HALF)
