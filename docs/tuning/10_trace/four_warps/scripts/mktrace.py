import os
here = os.path.dirname(os.path.abspath(__file__))
s=open(os.path.join(here, '../../../../../flashcore_numba/phases/p10_split_keys.py')).read()
s=s.replace("from ..arch","from flashcore_numba.arch").replace("from .common","from flashcore_numba.phases.common").replace("from .p07_mma_sync","from flashcore_numba.phases.p07_mma_sync")
def rep(a,b):
    global s
    assert a in s, a
    s=s.replace(a,b,1)
rep("def attend(Q, K, V, O, LSE, causal, qk_scale, O_PART, LSE_PART, COUNTERS, SEQLENS, BLOCK_TABLE):",
    "def attend(Q, K, V, O, LSE, causal, qk_scale, O_PART, LSE_PART, COUNTERS, SEQLENS, BLOCK_TABLE, TRACE):")
rep('''        """The whole of one block's work (the kernels below only name their arguments)."""
''','''        """The whole of one block's work (the kernels below only name their arguments)."""
        t_0 = glt()
        blk = ((cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y) * cuda.gridDim.x + cuda.blockIdx.x) * WARPS + cuda.threadIdx.x // 32
''')
rep('''        wait_pending()  # the first group, Q's rows with the first tile, has landed
''','''        wait_pending()  # the first group, Q's rows with the first tile, has landed
        t_1 = glt()
''')
rep('''        # -- the rows' sums over the quad''','''        t_2 = glt()
        # -- the rows' sums over the quad''')
rep('''        # -- merge, as a tree. Level 0 is the block''','''        if lane == 0:
            TRACE[blk, 0] = t_0
            TRACE[blk, 1] = t_1
            TRACE[blk, 2] = t_2
            TRACE[blk, 3] = glt()
        level = 0
        # -- merge, as a tree. Level 0 is the block''')
rep('''        if last_level:
            return

        # -- the levels across blocks''','''        if last_level:
            if lane == 0:
                TRACE[blk, 4] = glt()
                TRACE[blk, 5] = 100
            return
        level = 1

        # -- the levels across blocks''')
rep('''            if not arrive(COUNTERS, counters + team, members, tid, done_s):
                return  # another block of the team merges it''','''            if not arrive(COUNTERS, counters + team, members, tid, done_s):
                if lane == 0:
                    TRACE[blk, 4] = glt()
                    TRACE[blk, 5] = level
                return  # another block of the team merges it''')
rep('''            if last_level:
                return
''','''            if last_level:
                if lane == 0:
                    TRACE[blk, 4] = glt()
                    TRACE[blk, 5] = 100 + level
                return
            level += 1
''')
rep('''    def split_keys_attention(Q, K, V, O, LSE, causal, qk_scale, O_PART, LSE_PART, COUNTERS):
        attend(Q, K, V, O, LSE, causal, qk_scale, O_PART, LSE_PART, COUNTERS, COUNTERS, COUNTERS)''',
'''    def split_keys_attention(Q, K, V, O, LSE, causal, qk_scale, O_PART, LSE_PART, COUNTERS, TRACE):
        attend(Q, K, V, O, LSE, causal, qk_scale, O_PART, LSE_PART, COUNTERS, COUNTERS, COUNTERS, TRACE)''')
rep('''    def split_keys_kvcache(Q, K, V, O, LSE, causal, qk_scale, O_PART, LSE_PART, COUNTERS, SEQLENS, BLOCK_TABLE):
        attend(Q, K, V, O, LSE, causal, qk_scale, O_PART, LSE_PART, COUNTERS, SEQLENS, BLOCK_TABLE)''','''    def split_keys_kvcache(Q, K, V, O, LSE, causal, qk_scale, O_PART, LSE_PART, COUNTERS, SEQLENS, BLOCK_TABLE, TRACE):
        attend(Q, K, V, O, LSE, causal, qk_scale, O_PART, LSE_PART, COUNTERS, SEQLENS, BLOCK_TABLE, TRACE)''')
rep('''    PAGED = paged
''','''    PAGED = paged
    glt = ptx.function("trace.ptx", "flashcore_globaltimer_lo", "inline")
''')
open(os.path.join(here, 'p10_trace.py'),'w').write(s)  # beside trace_run.py, which imports it (it ran from .scratch/exp48)
