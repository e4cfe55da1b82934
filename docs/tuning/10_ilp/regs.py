"""Here, no GPU: registers and spills of p10v.py's builds for sm_90a (env LAZY, SPLITQK; argv: warps block_n stages)."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
import p10v
from numba import cuda
from flashcore_numba.measure import machine_code as mc
from flashcore_numba.arch.compile_speed import shared_inline_memo
W, BN, ST = (int(x) for x in sys.argv[1:4])
cfg = p10v.build_kernel(p10v.split_layout(128, BN, ST), "float16", warps=W)
sig = mc.signature(cfg)
with shared_inline_memo():
    ptx, _ = cuda.compile_ptx(cfg.kernel.py_func, sig, cc=(9, 0))
log, cubin = mc.assemble(ptx)
print(sys.argv[1:], "LAZY", p10v.LAZY, "SPLITQK", p10v.SPLITQK, mc.parse_resource_usage(log), "smem", p10v.smem_size(p10v.split_layout(128, BN, ST), W))
