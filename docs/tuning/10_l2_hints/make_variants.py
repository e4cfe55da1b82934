"""Writes copies of the package under $1 (default /tmp/l2v), one a variant, each differing from the
checkout only in ptx/cp_async.ptx's one cp.async instruction (flashcore_cp_async_16): an L2 prefetch
size, an L2 eviction policy, or both. Every kernel that copies by cp.async (phases 07-12 and this
folder's reader) then runs with it. Prints the variants' names."""
import shutil, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BASE = "    cp.async.cg.shared.global   [%dst], [%src], 16, %n;"
POLICY = "    .reg .b64   %pol;\n    createpolicy.fractional.L2::evict_first.b64 %pol, 1.0;\n"
VARIANTS = {
    "base": BASE,
    "p128": "    cp.async.cg.shared.global.L2::128B   [%dst], [%src], 16, %n;",
    "p256": "    cp.async.cg.shared.global.L2::256B   [%dst], [%src], 16, %n;",
    "ef": POLICY + "    cp.async.cg.shared.global.L2::cache_hint   [%dst], [%src], 16, %n, %pol;",
    "ef256": POLICY + "    cp.async.cg.shared.global.L2::cache_hint.L2::256B   [%dst], [%src], 16, %n, %pol;",
}


def write(dest: Path, names=VARIANTS):
    text = (ROOT / "ptx/cp_async.ptx").read_text()
    assert text.count(BASE) == 1
    for name in names:
        d = dest / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        shutil.copytree(ROOT / "flashcore_numba", d / "flashcore_numba",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(ROOT / "ptx", d / "ptx")
        (d / "ptx/cp_async.ptx").write_text(text.replace(BASE, VARIANTS[name]))
    return list(names)


if __name__ == "__main__":
    dest = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/l2v")
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(VARIANTS)
    print(",".join(write(dest, names)))
