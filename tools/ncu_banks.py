"""Launch phases once for Nsight Compute's shared-memory bank-conflict counters.

    ncu --clock-control none --csv --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,\
        l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,\
        l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__inst_executed_op_shared_ld.sum \
        python3 tools/ncu_banks.py 03 04 05 > docs/bench/ncu_bank_conflicts_h100.csv
"""
import sys

import numpy as np
from numba import cuda
from flashcore_numba.phases import PHASES
from flashcore_numba.phases.common import LOG2E
from flashcore_numba.reference import random_qkv
q, k, v = random_qkv((1, 8, 1024, 64), seed=0)
dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
o = cuda.device_array(q.shape, np.float16)
for pid in sys.argv[1:]:
    PHASES[pid].build(64).launch(dq, dk, dv, o, False, LOG2E / 8)
cuda.synchronize()
