"""Writes p10v3.py beside this file: phase 10's module as it is at commit b98d182 (its edits match
that version) with each ldmatrix's swizzled address worked out once a warp instead of once a
tile (README.md, "What the loop is made of now"). In a swizzled row, step kk of a lane's address
is rel ^ (32 kk) (`at`); with rel = base + lane_rel, where base (the stage's offset plus whole rows)
is a multiple of a row and 32 kk is less than a row, that is base + (lane_rel ^ 32 kk). So the
warp keeps k_lane ^ 32 kk for every k-step (KQ registers) and v_lane ^ 32 jj for every column
step (NO / 2), and a tile's ldmatrix address is the stage's start plus one of them (one add a
k-step, the rows an immediate) where it was an XOR and an add each. Not yet timed: for
the next A/B (ab.py with MODULE=p10v3)."""
from pathlib import Path

here = Path(__file__).parent
src = (here / "../../../flashcore_numba/phases/p10_split_keys.py").read_text()
edits = [
    ("from ..arch import", "from flashcore_numba.arch import"),
    ("    pv_steps = unrolled(pv_step, NO // 2)\n",
     "    pv_steps = unrolled(pv_step, NO // 2)\n    V_STEPS = NO // 2  # (a constant for the local array's shape)\n"),
    ("from ..arch.sim import", "from flashcore_numba.arch.sim import"),
    ("from .common import", "from flashcore_numba.phases.common import"),
    ("from .p07_mma_sync import", "from flashcore_numba.phases.p07_mma_sync import"),
    ("""        s, q_frag, smem, k_rel = args
        for jj in range(NT // 2):
            b0, b1, b2, b3 = ldsm(at(smem, k_rel + jj * 16 * ROW_BYTES, kk))
""", """        s, q_frag, kx, k_base = args
        for jj in range(NT // 2):
            b0, b1, b2, b3 = ldsm((k_base + kx[kk]) + uint32(jj * 16 * ROW_BYTES))
"""),
    ("""        acc, p_frag, smem, v_rel = args
        for kk in range(KP):
            b0, b1, b2, b3 = ldsm_t(at(smem, v_rel + kk * 16 * ROW_BYTES, jj))
""", """        acc, p_frag, vx, v_base = args
        for kk in range(KP):
            b0, b1, b2, b3 = ldsm_t((v_base + vx[jj]) + uint32(kk * 16 * ROW_BYTES))
"""),
    ("""        v_lane = uint32((((lane // 8) % 2) * 8 + lane % 8) * ROW_BYTES + ((lane // 16) ^ sw) * 16)
""", """        v_lane = uint32((((lane // 8) % 2) * 8 + lane % 8) * ROW_BYTES + ((lane // 16) ^ sw) * 16)
        kx = cuda.local.array(KQ, uint32)  # the lane's ldmatrix offset of each k-step in a tile of K
        for kk in range(KQ):
            kx[kk] = k_lane ^ uint32(kk * 32)
        vx = cuda.local.array(V_STEPS, uint32)  # and of each 16 output columns of V
        for jj in range(V_STEPS):
            vx[jj] = v_lane ^ uint32(jj * 32)
"""),
    ("            qk_half(0, (s, q_frag, smem, uint32(K_OFF + stage * STAGE_BYTES) + k_lane))\n",
     "            qk_half(0, (s, q_frag, kx, smem + uint32(K_OFF + stage * STAGE_BYTES)))\n"),
    ("            qk_half(KQ // 2, (s_hi, q_frag, smem, uint32(K_OFF + stage * STAGE_BYTES) + k_lane))\n",
     "            qk_half(KQ // 2, (s_hi, q_frag, kx, smem + uint32(K_OFF + stage * STAGE_BYTES)))\n"),
    ("            pv_steps(0, (acc, p_frag, smem, uint32(V_OFF + stage * STAGE_BYTES) + v_lane))\n",
     "            pv_steps(0, (acc, p_frag, vx, smem + uint32(V_OFF + stage * STAGE_BYTES)))\n"),
]
# p10v3a.py: the same with the shared address folded into kx and vx (ptxas then lays out 394
# instructions of math a tile, where p10v3.py has 427); the simulator cannot run it (its shared
# addresses are objects, not integers, and do not fit a uint32 array), so only the GPU checks it
ABSOLUTE = [("kx[kk] = k_lane ^ uint32(kk * 32)", "kx[kk] = smem + (k_lane ^ uint32(kk * 32))"),
            ("vx[jj] = v_lane ^ uint32(jj * 32)", "vx[jj] = smem + (v_lane ^ uint32(jj * 32))"),
            ("(k_base + kx[kk])", "(kx[kk] + k_base)"), ("(v_base + vx[jj])", "(vx[jj] + v_base)"),
            ("(s, q_frag, kx, smem + uint32(K_OFF", "(s, q_frag, kx, uint32(K_OFF"),
            ("(s_hi, q_frag, kx, smem + uint32(K_OFF", "(s_hi, q_frag, kx, uint32(K_OFF"),
            ("(acc, p_frag, vx, smem + uint32(V_OFF", "(acc, p_frag, vx, uint32(V_OFF")]
for old, new in edits:
    assert src.count(old) == 1, old
    src = src.replace(old, new)
(here / "p10v3.py").write_text(src)
for old, new in ABSOLUTE:
    assert src.count(old) == 1, old
    src = src.replace(old, new)
(here / "p10v3a.py").write_text(src)
