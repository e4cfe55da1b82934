"""Writes p10v.py beside this file: phase 10's module with two changes of its key loop that
environment variables switch on (module globals, folded when Numba compiles):
LAZY=1  the running maxima move only when some row of the warp sees a score more than 2^8 above
        its reference (a vote across the warp): until then acc and l_i are not rescaled, and
        p = 2^(s - m_ref) may reach 256 (fp16 holds it; the sums are float32). The result is
        the same function: l_i and acc are both relative to the m_i the warp keeps.
SPLITQK=1  s = q kᵀ summed in two halves of the head dim, each its own chain of mma.sync, then
        added: half as long a chain of dependent products per tile."""
from pathlib import Path

here = Path(__file__).parent
src = (here / "../../../flashcore_numba/phases/p10_split_keys.py").read_text()
edits = [
    ("from ..arch import", "from flashcore_numba.arch import"),
    ("from ..arch.sim import", "from flashcore_numba.arch.sim import"),
    ("from .common import", "from flashcore_numba.phases.common import"),
    ("from .p07_mma_sync import", "from flashcore_numba.phases.p07_mma_sync import"),
    ('ID = "10"', 'import os\nLAZY = os.environ.get("LAZY") == "1"\nSPLITQK = os.environ.get("SPLITQK") == "1"\nID = "10"'),
    ("    qk_steps = unrolled(qk_step, KQ)\n",
     "    qk_steps = unrolled(qk_step, KQ)\n    qk_half = unrolled(qk_step, KQ // 2)\n"),
    ("        s = cuda.local.array((NT, 4), float32)\n",
     "        s = cuda.local.array((NT, 4), float32)\n        s2 = cuda.local.array((NT, 4), float32)\n"),
    ("        l_b = float32(0.0)\n\n",
     "        l_b = float32(0.0)\n        m_ref_a = float32(0.0)\n        m_ref_b = float32(0.0)\n\n"),
    ("""            for j in range(NT):
                for e in range(4):
                    s[j, e] = float32(0.0)
            qk_steps(0, (s, q_frag, smem, uint32(K_OFF + stage * STAGE_BYTES) + k_lane))
""", """            for j in range(NT):
                for e in range(4):
                    s[j, e] = float32(0.0)
                    s2[j, e] = float32(0.0)
            if SPLITQK:
                qk_half(0, (s, q_frag, smem, uint32(K_OFF + stage * STAGE_BYTES) + k_lane))
                qk_half(KQ // 2, (s2, q_frag, smem, uint32(K_OFF + stage * STAGE_BYTES) + k_lane))
                for j in range(NT):
                    for e in range(4):
                        s[j, e] += s2[j, e]
            else:
                qk_steps(0, (s, q_frag, smem, uint32(K_OFF + stage * STAGE_BYTES) + k_lane))
"""),
    ("""            m_a, m_ref_a, alpha_a = softmax_rescale(m_a, m_ij_a * scale)
            m_b, m_ref_b, alpha_b = softmax_rescale(m_b, m_ij_b * scale)
            l_a *= alpha_a
            l_b *= alpha_b
            for j in range(NO):
                acc[j, 0] *= alpha_a
                acc[j, 1] *= alpha_a
                acc[j, 2] *= alpha_b
                acc[j, 3] *= alpha_b
""", """            grow = 1
            if LAZY:
                grow = cuda.any_sync(FULL_MASK, int32(1) if (m_ij_a * scale > m_a + float32(8.0) or
                                                              m_ij_b * scale > m_b + float32(8.0)) else int32(0))
            if grow != 0:
                m_a, m_ref_a, alpha_a = softmax_rescale(m_a, m_ij_a * scale)
                m_b, m_ref_b, alpha_b = softmax_rescale(m_b, m_ij_b * scale)
                l_a *= alpha_a
                l_b *= alpha_b
                for j in range(NO):
                    acc[j, 0] *= alpha_a
                    acc[j, 1] *= alpha_a
                    acc[j, 2] *= alpha_b
                    acc[j, 3] *= alpha_b
"""),
]
for old, new in edits:
    assert src.count(old) == 1, old
    src = src.replace(old, new)
(here / "p10v.py").write_text(src)
