"""Writes p10v5.py beside this file: phase 10's module (as at commit 730a1ce) with tile t + 1's
q · kᵀ issued before tile t's softmax, so that the two chains overlap on the warp's one scheduler
(Nsight Compute: one warp a scheduler, an instruction every 6.2 cycles, each waiting on the one
before; docs/tuning/10_ncu_cudnn/). Dense build only (the A/B's); the paged build is untouched.

K leads V by one tile, in rings of STAGES slots each: group G_i holds K(i + 1) and V(i) (G_-1 Q and
K(0)). At the top of iteration t the wait leaves one group in flight (as the package's loop) and
so has G_t: K(t + 1) for the next tile's scores and V(t) for this tile's p · v. Then the iteration
copies K(t + 3) into K(t)'s slot (its scores were taken an iteration ago) and V(t + 2) into
V(t - 1)'s: every copy is still issued two iterations ahead of its use, as before."""
from pathlib import Path

here = Path(__file__).parent
src = (here / "../../../flashcore_numba/phases/p10_split_keys.py").read_text()
edits = [
    ("from ..arch import", "from flashcore_numba.arch import"),
    ("from ..arch.sim import", "from flashcore_numba.arch.sim import"),
    ("from .common import", "from flashcore_numba.phases.common import"),
    ("from .p07_mma_sync import", "from flashcore_numba.phases.p07_mma_sync import"),
    ('    wait_pending = ptx.function("cp_async.ptx", f"flashcore_cp_async_wait_{STAGES - 2}", "inline")\n',
     '    wait_pending = ptx.function("cp_async.ptx", f"flashcore_cp_async_wait_{STAGES - 2}", "inline")\n'
     '    wait_first = ptx.function("cp_async.ptx", f"flashcore_cp_async_wait_{STAGES - 1}", "inline")\n'),
    # the prologue: G_-1 = Q, K(0); G_0 = K(1), V(0); G_1 = K(2), V(1)
    ("""        for st in range(STAGES - 1):
            key0 = k_start + st * BLOCK_N
            if key0 < k_stop:
                if PAGED and whole_tiles:
                    pages = tile_pages(BLOCK_TABLE, b, key0, seq_k, page_size)
                copy_kv(smem, st, K, V, head_kv, h_kv, key0, seq_k, lane, BLOCK_TABLE, b, pages, whole_tiles)
            commit()
""", """        for st in range(STAGES):
            key0 = k_start + st * BLOCK_N
            if key0 < k_stop:
                copy_tile(smem, K_OFF + st * STAGE_BYTES, global_address(K), head_kv, key0, BLOCK_N, seq_k, lane, ROW)
            if st >= 1 and key0 - BLOCK_N < k_stop:
                copy_tile(smem, V_OFF + (st - 1) * STAGE_BYTES, global_address(V), head_kv, key0 - BLOCK_N,
                          BLOCK_N, seq_k, lane, ROW)
            commit()
"""),
    ("""        wait_pending()  # the first group, Q's rows with the first tile, has landed
""", """        wait_first()  # the first group, Q's rows with K(0), has landed
"""),
    ("""        v_lane = uint32((((lane // 8) % 2) * 8 + lane % 8) * ROW_BYTES + ((lane // 16) ^ sw) * 16)
""", """        v_lane = uint32((((lane // 8) % 2) * 8 + lane % 8) * ROW_BYTES + ((lane // 16) ^ sw) * 16)
        s_nx = cuda.local.array((NT, 4), float32)  # the next tile's q · kᵀ, lower half of the head dim
        for j in range(NT):
            for e in range(4):
                s_nx[j, e] = float32(0.0)
                s_hi[j, e] = float32(0.0)
        if k_start < k_stop:  # tile 0's scores, before the loop
            qk_half(0, (s_nx, q_frag, smem, uint32(K_OFF) + k_lane))
            qk_half(KQ // 2, (s_hi, q_frag, smem, uint32(K_OFF) + k_lane))
        for j in range(NT):
            for e in range(4):
                s[j, e] = s_nx[j, e] + s_hi[j, e]
"""),
    ("""            next_n = start_n + int32((STAGES - 1) * BLOCK_N)
            if next_n < k_stop:
                copy_kv(smem, (stage + STAGES - 1) % STAGES, K, V, head_kv, h_kv, next_n, seq_k, lane, BLOCK_TABLE,
                        b, pages, whole_tiles)
                if PAGED and whole_tiles and next_n + BLOCK_N < k_stop:  # the tile after: its pages now
                    pages = tile_pages(BLOCK_TABLE, b, next_n + BLOCK_N, seq_k, page_size)
            commit()
            for j in range(NT):
                for e in range(4):
                    s[j, e] = float32(0.0)
                    s_hi[j, e] = float32(0.0)
            qk_half(0, (s, q_frag, smem, uint32(K_OFF + stage * STAGE_BYTES) + k_lane))
            qk_half(KQ // 2, (s_hi, q_frag, smem, uint32(K_OFF + stage * STAGE_BYTES) + k_lane))
            for j in range(NT):
                for e in range(4):
                    s[j, e] += s_hi[j, e]
""", """            k_next = start_n + int32(STAGES * BLOCK_N)  # K(t + 3), into K(t)'s slot
            if k_next < k_stop:
                copy_tile(smem, K_OFF + stage * STAGE_BYTES, global_address(K), head_kv, k_next, BLOCK_N, seq_k,
                          lane, ROW)
            v_next = start_n + int32((STAGES - 1) * BLOCK_N)  # V(t + 2), into V(t - 1)'s slot
            if v_next < k_stop:
                copy_tile(smem, V_OFF + ((stage + STAGES - 1) % STAGES) * STAGE_BYTES, global_address(V), head_kv,
                          v_next, BLOCK_N, seq_k, lane, ROW)
            commit()
            n_stage = stage + 1 if stage + 1 < STAGES else 0
            if start_n + BLOCK_N < k_stop:  # tile t + 1's scores, issued before tile t's softmax
                for j in range(NT):
                    for e in range(4):
                        s_nx[j, e] = float32(0.0)
                        s_hi[j, e] = float32(0.0)
                qk_half(0, (s_nx, q_frag, smem, uint32(K_OFF + n_stage * STAGE_BYTES) + k_lane))
                qk_half(KQ // 2, (s_hi, q_frag, smem, uint32(K_OFF + n_stage * STAGE_BYTES) + k_lane))
"""),
    ("""            pv_steps(0, (acc, p_frag, smem, uint32(V_OFF + stage * STAGE_BYTES) + v_lane))
            stage = stage + 1 if stage + 1 < STAGES else 0
""", """            pv_steps(0, (acc, p_frag, smem, uint32(V_OFF + stage * STAGE_BYTES) + v_lane))
            for j in range(NT):
                for e in range(4):
                    s[j, e] = s_nx[j, e] + s_hi[j, e]
            stage = n_stage
"""),
]
for old, new in edits:
    assert src.count(old) == 1, old
    src = src.replace(old, new)
(here / "p10v5.py").write_text(src)
