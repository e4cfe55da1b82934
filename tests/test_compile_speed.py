"""arch/compile_speed.py: Numba's inliner sharing one deepcopy memo per inlined call while the package
compiles. The code it makes must be the same as Numba's own (the GPU machine's A/B of 25 kernels:
docs/tuning/compile_time/); here, that the patch is in place only inside the block, that the switch
turns it off, and that a phase's PTX is the same both ways."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flashcore_numba.arch import compile_speed
from flashcore_numba.measure.machine_code import compiler_env

inline_closurecall = pytest.importorskip("numba.cuda.core.inline_closurecall")


def test_the_patch_holds_inside_the_block_only(monkeypatch):
    monkeypatch.delenv("FLASHCORE_SHARED_INLINE_MEMO", raising=False)
    if not compile_speed._applies():
        pytest.skip("this numba-cuda is not one the patch was checked on (compile_speed.CHECKED)")
    original = inline_closurecall.InlineWorker.inline_ir
    with compile_speed.shared_inline_memo():
        assert inline_closurecall.InlineWorker.inline_ir is not original
        assert isinstance(inline_closurecall.copy, compile_speed._SharedMemo)
        with compile_speed.shared_inline_memo():  # a compile inside another's keeps the outer patch
            assert isinstance(inline_closurecall.copy, compile_speed._SharedMemo)
        assert isinstance(inline_closurecall.copy, compile_speed._SharedMemo)
    assert inline_closurecall.InlineWorker.inline_ir is original
    assert inline_closurecall.copy is compile_speed.copy


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("FLASHCORE_SHARED_INLINE_MEMO", "0")
    original = inline_closurecall.InlineWorker.inline_ir
    with compile_speed.shared_inline_memo():
        assert inline_closurecall.InlineWorker.inline_ir is original
        assert inline_closurecall.copy is compile_speed.copy


@pytest.mark.slow
def test_a_phase_compiles_to_the_same_ptx_both_ways(monkeypatch):
    """Phase 05 (the common.py device functions inlined into its kernel) compiled for sm_90a with the
    shared memo and without it, in fresh interpreters without the simulator."""
    script = ("import json, re\n"
              "from flashcore_numba.measure import machine_code as m\n"
              "from flashcore_numba.arch import compile_speed\n"
              "calls = []\n"
              "inner = compile_speed._SharedMemo.deepcopy\n"
              "compile_speed._SharedMemo.deepcopy = lambda self, x, memo=None: calls.append(1) or inner(self, x, memo)\n"
              "ptx = re.sub(r'_ZN\\w+', 'NAME', m.compile_phase_ptx('05', 64))\n"
              "print(json.dumps({'ptx': ptx, 'shared': len(calls)}))\n")
    runs = {}
    for switch in ("1", "0"):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False,
                              env=compiler_env(FLASHCORE_SHARED_INLINE_MEMO=switch))
        assert done.returncode == 0, done.stderr[-3000:]
        runs[switch] = json.loads(done.stdout.strip().splitlines()[-1])
    monkeypatch.delenv("FLASHCORE_SHARED_INLINE_MEMO", raising=False)
    if compile_speed._applies():  # a numba-cuda the patch was checked on
        assert runs["1"]["shared"] > 0, "the compile did not go through the shared memo"
    assert runs["0"]["shared"] == 0
    assert runs["1"]["ptx"] == runs["0"]["ptx"]
