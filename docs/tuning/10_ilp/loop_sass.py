"""Here, no GPU: phase 10's kernel (D = 128 fp16, sm_90a) assembled and disassembled, and the
instructions of its key loop (or, given a module name, of that module's build) counted by opcode in two parts laid out once a tile: from the wait
for the oldest stage to the commit of the next tile's copies (the copies, and their addresses),
and from there to the loop's back branch (the products, the softmax, the rescale). Static counts
of the laid-out code: the copy part holds both the whole-tile path and the last tile's path."""
import collections, re, sys
from pathlib import Path
from flashcore_numba.measure import machine_code as mc

if len(sys.argv) > 1:  # a module beside this file (p10v2: make_variant2.py's), in place of the package's
    from numba import cuda
    from flashcore_numba.arch.compile_speed import shared_inline_memo
    sys.path.insert(0, str(Path(__file__).parent))
    mod = __import__(sys.argv[1])
    cfg = mod.build_kernel(mod.split_layout(128, **mod.TILES[128]), "float16")
    with shared_inline_memo():
        ptx, _ = cuda.compile_ptx(cfg.kernel.py_func, mc.signature(cfg), cc=mc.CC)
else:
    ptx = mc.compile_phase_ptx("10", 128)
_, cubin = mc.assemble(ptx)
lines = [l for l in mc.disassemble(cubin).splitlines() if re.match(r"\s+/\*[0-9a-f]+\*/", l)]
ops = [re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", l).split(" ")[0].rstrip(";") for l in lines]
wait = next(i for i, o in enumerate(ops) if o.startswith("DEPBAR") and i > len(ops) // 4)  # the loop's wait
commit = next(i for i in range(wait, len(ops)) if ops[i] == "LDGDEPBAR")
vote = next(i for i in range(commit, len(ops)) if ops[i].startswith("VOTE"))
back = next(i for i in range(vote, len(ops)) if ops[i] == "BRA" and "@P0" in lines[i])


def mix(a, b):
    c = collections.Counter(o.split(".")[0] for o in ops[a:b])
    return sum(c.values()), ", ".join(f"{k} {v}" for k, v in c.most_common())


for name, (a, b) in {"copies (wait .. commit)": (wait, commit), "math (commit .. back branch)": (commit, back)}.items():
    n, m = mix(a, b)
    print(f"{name}: {n} instructions\n    {m}")
