"""Run with PYTHONPATH at one of make_variants.py's copies: phase 10's kernel (D = 128, fp16) compiled
and assembled for sm_90a here (no GPU), its registers and its cp.async instructions (LDGSTS) as
ptxas lays them out, counted by their modifiers."""
import collections, re, sys
from flashcore_numba.arch import ptx as ptxmod
from flashcore_numba.measure import machine_code as mc

print("ptx dir", ptxmod.ptx_dir())
ptx = mc.compile_phase_ptx("10", 128)
log, cubin = mc.assemble(ptx)
print(mc.parse_resource_usage(log))
sass = mc.disassemble(cubin)
ops = collections.Counter(m.group(1) for m in re.finditer(r"\b(LDGSTS[.\w]*)", sass or ""))
print(dict(ops))
print("cp.async lines in PTX:", collections.Counter(re.findall(r"cp\.async\.cg[.\w:]*", ptx)))
