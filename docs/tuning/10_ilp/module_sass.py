"""Here, no GPU: registers of phase 10 (argv[1] `package`) or of a module beside this file (p10v3,
p10v3a, p10v4: make_variant3.py and make_variant4.py), D = 128 fp16, sm_90a, and its SASS written to
/tmp/<name>.sass, where README.md's lengths of the whole-tile copy path were counted by hand (from
the key loop's wait, DEPBAR.LE SB0 0x1, to the branch after the tile's LDGSTS)."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from flashcore_numba.measure import machine_code as mc
from numba import cuda
from flashcore_numba.arch.compile_speed import shared_inline_memo
name = sys.argv[1]
if name == "package":
    ptx = mc.compile_phase_ptx("10", 128)
else:
    mod = __import__(name)
    cfg = mod.build_kernel(mod.split_layout(128, **mod.TILES[128]), "float16")
    with shared_inline_memo():
        ptx, _ = cuda.compile_ptx(cfg.kernel.py_func, mc.signature(cfg), cc=mc.CC)
log, cubin = mc.assemble(ptx)
print(name, mc.parse_resource_usage(log))
sass = mc.disassemble(cubin)
open(f"/tmp/{name}.sass", "w").write(sass)
