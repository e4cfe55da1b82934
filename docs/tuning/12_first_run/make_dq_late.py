"""Writes flashcore_numba/phases/_ab_12late.py, the A/B variant of phase 12 with dQ one tile late (as
phase 11 does it: two dSᵀ buffers, no barrier between the dSᵀ stores and dQ), from phase 12 as it is
in this checkout: every edit is a text replacement that must match, so a change to phase 12 that
moves what it edits stops it with the line it looked for. docs/tuning/12_first_run/run.sh runs it
on the GPU machine, where tools/ab_backward.py then loads the variant from phases/ (the kernel cache
keeps only kernels written there).

    python3 docs/tuning/12_first_run/make_dq_late.py
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
t = (ROOT / "flashcore_numba/phases/p12_backward_wgmma.py").read_text()
doc_end = t.index('"""', 3) + 3
t = '''"""A/B variant of phase 12 (docs/tuning/12_history.md): dQ one tile late, as phase 11 does it. A
tile's dSᵀ goes to one of two buffers, and its dQ is computed and added during the next tile (the
last tile's after the loop), so the barrier between the dSᵀ stores and dQ is gone: the barrier that
ends every tile is the only one. Shared memory: one more dSᵀ buffer (32 KB at D = 64, 16 KB at
D = 128). Everything else is phase 12's (tools/ab_backward.py loads it from phases/, where
docs/tuning/12_first_run/run.sh copies it)."""''' + t[doc_end:]
reps = [
("             STREAM_ROWS=block_m, DS_BUFFERS=1, BLOCK_M=block_m)", "             STREAM_ROWS=block_m, DS_BUFFERS=2, BLOCK_M=block_m)"),
('''    L["SMEM_BYTES"] = L["DS_OFF"] + own * block_m * 2''', '''    L["DS_BYTES"] = own * block_m * 2  # buffer i of dSᵀ at DS_OFF + i * DS_BYTES
    L["SMEM_BYTES"] = L["DS_OFF"] + 2 * L["DS_BYTES"]'''),
('''    STREAM_TILE, STAGE, DS_OFF, DS_ATOM = L["STREAM_TILE"], L["STAGE_BYTES"], L["DS_OFF"], L["DS_ATOM"]''',
 '''    STREAM_TILE, STAGE, DS_OFF, DS_ATOM = L["STREAM_TILE"], L["STAGE_BYTES"], L["DS_OFF"], L["DS_ATOM"]
    DS_BYTES = L["DS_BYTES"]'''),
('''    @cuda.jit
    def kv_kernel(Q, K, V, dO, LSE, DELTA, dQ, dK, dV, causal, scale):''', '''    @cuda.jit(device=True, inline=True)
    def tile_dq(smem, buffer, prev_s, dq_address, b, H, seq_q, wg, warp, g, t, dq, scale):
        """dQ += scale · dS K for the tile whose dSᵀ is in buffer `buffer` and whose query head and
        first row are prev_s[buffer]: this warpgroup's pieces."""
        h, m0 = prev_s[buffer, 0], prev_s[buffer, 1]
        dq_head = dq_address + uint64(((b * H + h) * seq_q) * DQ_ROW)
        for piece in range(WG_PIECES):
            p_id = wg + piece * WARPGROUPS_
            r0, c0 = (p_id // COL_BLOCKS) * 64, (p_id % COL_BLOCKS) * 64  # its query rows and columns
            ds_atom = smem + DS_OFF + buffer * DS_BYTES + (r0 // 64) * DS_ATOM
            k_atom = smem + K_OFF + (c0 // 64) * ATOM
            store_tuple(dq, dq_first(descriptor(ds_atom, ATOM, GROUP, SW128),
                                     descriptor(k_atom, ATOM, GROUP, SW128)))
            for half in range(1, KEY_HALVES):
                store_tuple(dq, dq_acc(descriptor(ds_atom + half * WG_M * ROW, ATOM, GROUP, SW128),
                                       descriptor(k_atom + half * KV_TILE, ATOM, GROUP, SW128),
                                       as_tuple(dq, N_DQ)))
            row_a = m0 + r0 + warp * 16 + g
            for j in range(8):
                at = dq_head + uint64(row_a * DQ_ROW + (c0 + j * 8 + 2 * t) * 4)
                if row_a < seq_q:
                    red_pair(at, dq[j, 0] * scale, dq[j, 1] * scale)
                if row_a + 8 < seq_q:
                    red_pair(at + uint64(8 * DQ_ROW), dq[j, 2] * scale, dq[j, 3] * scale)

    @cuda.jit
    def kv_kernel(Q, K, V, dO, LSE, DELTA, dQ, dK, dV, causal, scale):'''),
('''        delta_s = cuda.shared.array(STATS, float32)  # and Δ_i
''', '''        delta_s = cuda.shared.array(STATS, float32)  # and Δ_i
        prev_s = cuda.shared.array((2, 2), int32)  # (query head, first row) of the tile whose dSᵀ is in buffer i
'''),
('''        ds_row = uint32((DS_OFF + (wg * 64 + warp * 16 + g) * ROW) // 4 + t)''',
 '''        ds_row0 = uint32((DS_OFF + (wg * 64 + warp * 16 + g) * ROW) // 4 + t)'''),
('''                for kk in range(KS):
                    atom = uint32((kk // 4) * DS_ATOM_WORDS)''', '''                ds_row = ds_row0 + uint32(stage * (DS_BYTES // 4))  # buffer `stage`
                for kk in range(KS):
                    atom = uint32((kk // 4) * DS_ATOM_WORDS)'''),
('''            # -- dK = scale · Σ dSᵀ Q and dV, in the inputs' type (phase 11's)''', '''            # -- dQ of the last tile (its dSᵀ and prev_s, behind the loop's last barrier)
            if n_tiles > 0:
                tile_dq(smem, (n_tiles - 1) % 2, prev_s, dq_address, b, H, seq_q, wg, warp, g, t, dq, scale)

            # -- dK = scale · Σ dSᵀ Q and dV, in the inputs' type (phase 11's)'''),
]
for a, b in reps:
    assert a in t, a[:70]; t = t.replace(a, b)
start = t.index('''                fence_proxy_async()  # the stores become visible to the tensor cores ...''')
end = t.index('''                # -- the next tile has landed (this thread's copies), and every warp is done with this''')
t = t[:start] + '''                fence_proxy_async()  # the stores become visible to the tensor cores after the tile's barrier
                if tid == 0:  # whose dSᵀ it is (a slot per buffer: the tile before's is read now)
                    prev_s[stage, 0], prev_s[stage, 1] = h, m0
                # -- dQ of the tile before, one tile late: its dSᵀ was stored before the barrier that ended it
                if it > 0:
                    tile_dq(smem, 1 - stage, prev_s, dq_address, b, H, seq_q, wg, warp, g, t, dq, scale)

''' + t[end:]
t = "\n".join(l for l in t.split("\n") if ">>> exercise" not in l and "<<< exercise" not in l)
(ROOT / "flashcore_numba/phases/_ab_12late.py").write_text(t)
print("wrote flashcore_numba/phases/_ab_12late.py")
