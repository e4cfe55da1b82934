"""The call path without a GPU: the packed launch parameters against Numba's own, the kernel cache
(keys, entries, corrupted entries rebuilt), and torch.compile tracing attention() as one custom op.

What needs the GPU (a plan's launch, CUDA-graph capture and replay, a warm-cache first call in a
new process) is in tests/test_gpu.py.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import subprocess
import sys
import types as pytypes
from pathlib import Path

import numpy as np
import pytest

from flashcore_numba.runtime.plan import Plans

from flashcore_numba.arch import cache, launch
from flashcore_numba.arch.launch import ArgSlots, ArrayArg, ScalarArg
from flashcore_numba.arch.sim import simulator_enabled

# The simulator replaces numba.cuda's compiler, and a CPU session runs in it. The tests marked
# `compiler` need the real one, which a CPU machine has (NVVM and nvJitLink from pip): in a simulator
# session they run in a child pytest without it (a background job, see conftest.py), and
# test_compiler_tests_pass_without_the_simulator reads its result.
COMPILER_TESTS = 8
NO_TORCH = "torch is not installed (pip install -e '.[torch]')"  # the tests that need it skip


def needs_compiler(test):
    return pytest.mark.compiler(pytest.mark.skipif(
        simulator_enabled(), reason="run without the simulator, in a child pytest "
                                    "(test_compiler_tests_pass_without_the_simulator)")(test))


def _run_compiler_tests():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["FLASHCORE_GPU"] = "1"  # conftest.py: no simulator (GPU tests skip where there is no GPU)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "compiler",
                           __file__], capture_output=True, text=True, env=env, timeout=900, check=False,
                          cwd=Path(__file__).resolve().parent.parent)


def start_background(items, pool):
    this_module = sys.modules[__name__]
    if any(getattr(item, "module", None) is this_module and "compiler_run" in item.fixturenames for item in items):
        return pool.submit(_run_compiler_tests)
    return None


@pytest.fixture(scope="module")
def compiler_run(background):
    if background is None or background.cancel():
        return _run_compiler_tests()
    return background.result()


@pytest.mark.slow
def test_compiler_tests_pass_without_the_simulator(compiler_run):
    if not simulator_enabled():
        pytest.skip("this session has no simulator: the compiler tests ran in it directly")
    assert compiler_run.returncode == 0, compiler_run.stdout[-3000:] + compiler_run.stderr[-3000:]
    assert f"{COMPILER_TESTS} passed" in compiler_run.stdout, compiler_run.stdout[-2000:]


def numba_packed(argtypes, values) -> list[bytes]:
    """The bytes behind each kernel parameter as numba-cuda packs them for cuLaunchKernel: its own
    `_Kernel._prepare_args` on cuda.core views of host arrays (the constructor that needs no driver),
    then cuda.core's ParamHolder, as `cuda.core.launch` does."""
    from cuda.core._kernel_arg_handler import ParamHolder
    from cuda.core.utils import StridedMemoryView
    from numba.cuda import dispatcher

    me = pytypes.SimpleNamespace(extensions=[])
    me._prepare_args = lambda *args: dispatcher._Kernel._prepare_args(me, *args)  # a tuple's members
    packed = []
    for t, v in zip(argtypes, values, strict=True):
        if isinstance(v, np.ndarray):
            v = StridedMemoryView.from_dlpack(v, stream_ptr=-1)
        dispatcher._Kernel._prepare_args(me, t, v, 0, [], packed)
    holder = ParamHolder(packed)
    pointers = (ctypes.c_void_p * len(packed)).from_address(holder.ptr)
    return [ctypes.string_at(pointers[i], 8) for i in range(len(packed))]


def test_arg_slots_take_new_pointers_shapes_scalars_and_grids():
    """What a call writes into a plan's packed parameters: data pointers (set_pointers writes those
    that changed), a new shape of an array (attention_varlen's packed lengths) and a new scalar are
    the bytes of arguments made with those values in the first place; a Launcher takes a new grid."""
    made = ArgSlots([ArrayArg((1, 7, 4, 64), 2), ScalarArg("int32", 5), ArrayArg((3,), 4), ScalarArg("float32", 1.5)])
    fresh = ArgSlots([ArrayArg((1, 300, 4, 64), 2), ScalarArg("int32", 99), ArrayArg((3,), 4),
                      ScalarArg("float32", 1.5)])
    made.set_shape(0, (1, 300, 4, 64))
    made.set_scalar(1, 99)
    made.set_pointers((0, 2), (0x7000, 0x9000))
    fresh.set_pointer(0, 0x7000)
    fresh.set_pointer(2, 0x9000)
    assert made.values() == fresh.values()
    made.set_pointers((0, 2), (0x7000, 0xA000))  # only the second changed
    fresh.set_pointer(2, 0xA000)
    assert made.values() == fresh.values()
    with pytest.raises(ValueError, match="argument 0: 3 dimensions, the kernel takes 4"):
        made.set_shape(0, (1, 2, 3))
    kernel = launch.Kernel(library=None, handle=None, entry="k", function=object())
    launcher = launch.Launcher(kernel, (1, 1, 1), 128, 0, made)
    launcher.grid = (7, 4, 2)
    assert launcher.grid == (7, 4, 2)


@needs_compiler
def test_arg_slots_are_numbas_parameters():
    """Phase 09's argument list (bf16 as int16, O as uint32 pairs, the LSE, the maps, the counter), packed by
    ArgSlots and by numba-cuda itself: the same bytes in every parameter, over the size each has."""
    from numba.cuda import types

    q = np.zeros((2, 3, 5, 64), np.int16)
    k = np.zeros((2, 1, 7, 64), np.int16)
    o = np.zeros((2, 3, 5, 32), np.uint32)
    maps, counter = np.zeros((3, 16), np.uint64), np.zeros(1, np.int32)
    lse = np.zeros((2, 3, 5), np.float32)
    values = [q, k, k, o, lse, True, np.float32(0.18), maps, counter]
    argtypes = [types.Array(types.int16, 4, "C")] * 3 + [types.Array(types.uint32, 4, "C"),
                                                          types.Array(types.float32, 3, "C"), types.boolean,
                                                          types.float32, types.Array(types.uint64, 2, "C"),
                                                          types.Array(types.int32, 1, "C")]
    slots = ArgSlots([ArrayArg(q.shape, 2), ArrayArg(k.shape, 2), ArrayArg(k.shape, 2), ArrayArg(o.shape, 4),
                      ArrayArg(lse.shape, 4), ScalarArg("bool", True), ScalarArg("float32", 0.18),
                      ArrayArg(maps.shape, 8), ArrayArg(counter.shape, 4)])
    for i, array in enumerate((q, k, k, o, lse, None, None, maps, counter)):
        if array is not None:
            slots.set_pointer(i, array.ctypes.data)
    numba = numba_packed(argtypes, values)
    ours = [int(x).to_bytes(8, "little") for x in slots.values()]
    assert len(ours) == len(numba) == len(slots.sizes) == 4 * 13 + 11 + 1 + 1 + 9 + 7
    for i, (a, b, size) in enumerate(zip(ours, numba, slots.sizes, strict=True)):
        assert a[:size] == b[:size], f"parameter {i}: ours {a[:size].hex()}, numba's {b[:size].hex()}"


@needs_compiler
@pytest.mark.parametrize("base", ["09", "07"])
def test_flex_plan_packs_what_numba_packs(base, monkeypatch):
    """flex_attention's plan (runtime/flex.py) on phase `base`'s kernel with a score_mod and a mask_mod
    of one bound array each: every parameter it packs, the addresses written by a call included (q, k,
    v, out, the LSE, phase 09's tensor maps and work counter, the block lists, each mod's tuple of
    arrays), is the bytes numba-cuda packs for the same arguments, and its argument types are those
    Numba's launch types them with. No GPU: the driver, the device and the maps are stand-ins."""
    from cuda.core.utils import StridedMemoryView

    from flashcore_numba import flex
    from flashcore_numba.arch.cache import CachedKernel
    from flashcore_numba.arch.smem import argument_types
    from flashcore_numba.phases import p14_flex
    from flashcore_numba.runtime import flex as runtime_flex

    B, H, H_kv, S, D = 2, 4, 2, 300, 64
    score, mask = flex.softcap(30.0), flex.document_mask(np.zeros((B, S), np.int32))
    config = p14_flex.build(D, "bfloat16", score.fn, 1, mask.fn, 1, base)
    q, out = np.zeros((B, H, S, D), np.int16), np.zeros((B, H, S, D), np.int16)
    k, v = np.zeros((B, H_kv, S, D), np.int16), np.zeros((B, H_kv, S, D), np.int16)
    lse = np.zeros((B, H, S), np.float32)
    maps, counter = np.zeros((3, 16), np.uint64), np.zeros(1, np.int32)
    count_shape = (B, 1, 3, 2) if base == "09" else (B, 1, 3)
    lists = (np.zeros(count_shape, np.int32), np.zeros((B, 1, 3, 3), np.int32), np.zeros((B, 1, 3, 3), np.int8))
    tail = (*lists, (np.zeros(1, np.float32),), (np.zeros((B, S), np.int32),))
    launched = []
    monkeypatch.setattr(runtime_flex, "device_facts", lambda *a: ((9, 0), (132, 1, 1)))
    monkeypatch.setattr(runtime_flex, "cached_cubin", lambda *a: CachedKernel(b"", "k", "key", False))
    monkeypatch.setattr(runtime_flex, "loaded_kernel", lambda *a: launch.Kernel(None, None, "k", object()))
    monkeypatch.setattr(ArgSlots, "check", lambda *a: None)
    monkeypatch.setattr(runtime_flex.driver, "Launcher", lambda *a: lambda stream: launched.append((a, stream)))
    monkeypatch.setattr(runtime_flex.driver, "primary_context", lambda index: 0)
    monkeypatch.setattr(runtime_flex.driver, "make_current", lambda context: 0)
    monkeypatch.setattr(runtime_flex.driver, "restore", lambda previous, context: None)
    monkeypatch.setattr(runtime_flex.scratch, "work_counter",
                        lambda *a: pytypes.SimpleNamespace(addresses=(counter.ctypes.data,)))
    monkeypatch.setattr(runtime_flex, "DeviceMaps", lambda *a: pytypes.SimpleNamespace(
        address=lambda key, arrays: maps.ctypes.data))
    monkeypatch.setattr(runtime_flex, "address", lambda a: a.ctypes.data)
    plan = runtime_flex.FlexPlan(base, config, ("14", "test"), "bfloat16", q.shape, k.shape, v.shape, 0.2, tail, 0,
                                 return_lse=True, torch_memory=False)
    held = [pytypes.SimpleNamespace(data_ptr=lambda a=a: a.ctypes.data) for a in (q, k, v, out, lse)]
    plan(*held, runtime_flex.flat_arrays(tail), 7)
    assert len(launched) == 1 and launched[0][1] == 7
    out_arg = out.view(np.uint32) if base == "07" or config.packed_output else out  # O as uint32 pairs
    head = [q, k, v, out_arg, lse] + ([False, np.float32(0.2), maps, counter] if base == "09" else [np.float32(0.2)])
    assert plan.argtypes[:len(head)] == argument_types(config.kernel, head)
    assert plan.argtypes[len(head):] == argument_types(config.kernel, tail)

    def view(x):
        if isinstance(x, tuple):
            return tuple(view(a) for a in x)
        return StridedMemoryView.from_dlpack(x, stream_ptr=-1) if isinstance(x, np.ndarray) else x

    numba = numba_packed(plan.argtypes, [view(x) for x in (*head, *tail)])
    ours = [int(x).to_bytes(8, "little") for x in plan.slots.values()]
    assert len(ours) == len(numba) == len(plan.slots.sizes)
    for i, (a, b, size) in enumerate(zip(ours, numba, plan.slots.sizes, strict=True)):
        assert a[:size] == b[:size], f"parameter {i}: ours {a[:size].hex()}, numba's {b[:size].hex()}"


def test_launcher_launches_the_kernel_s_function_with_the_values_settled_once(monkeypatch):
    """Launcher calls cuda.bindings' cuLaunchKernel with the kernel's CUfunction, the grid, the block,
    the shared memory, the stream as given, the parameter buffer's address and no extra: a fake
    driver stands in and records the call. A failed launch raises with the driver's error name,
    and a kernel without a CUfunction (function_of never called) is refused when the launcher is made."""
    import enum

    seen = []

    class CUresult(enum.IntEnum):  # as cuda.bindings' own: CUDA_SUCCESS is 0, so falsy
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1

    result = [CUresult.CUDA_SUCCESS]

    def fake(*args):
        seen.append(args)
        return (result[0],)

    driver = pytypes.SimpleNamespace(cuLaunchKernel=fake, CUresult=CUresult)
    monkeypatch.setattr(launch, "_driver", lambda: driver)
    function = object()  # a CUfunction is an opaque handle
    kernel = launch.Kernel(library=None, handle=None, entry="k", function=function)
    slots = ArgSlots([ArrayArg((2, 3), 4), ScalarArg("bool", True)])
    launcher = launch.Launcher(kernel, (132, 16, 2), 256, 100_000, slots)
    launcher(0x5555_0000_0040)
    launcher(0)  # the legacy default stream
    assert seen == [(function, 132, 16, 2, 256, 1, 1, 100_000, 0x5555_0000_0040, slots.params, 0),
                    (function, 132, 16, 2, 256, 1, 1, 100_000, 0, slots.params, 0)]
    assert all(type(x) is int for x in seen[0][1:])  # plain integers: cuda.bindings converts nothing else
    result[0] = CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(RuntimeError, match=r"cuLaunchKernel\(k\) failed: CUDA_ERROR_INVALID_VALUE"):
        launcher(0)
    with pytest.raises(ValueError, match=r"kernel k: no CUfunction"):
        launch.Launcher(launch.Kernel(library=None, handle=None, entry="k"), (1, 1, 1), 32, 0, slots)


BACKWARD_PLAN_CASES = [  # (q shape, k shape, causal, deterministic, parts, with dlse, D's dtype)
    ((2, 4, 77, 64), (2, 2, 130, 64), True, False, 1, False, "float16"),
    ((1, 2, 300, 128), (1, 1, 333, 128), False, True, 1, True, "bfloat16"),
    ((1, 2, 300, 64), (1, 1, 333, 64), True, True, 3, False, "float16"),
    ((1, 2, 100, 200), (1, 1, 100, 200), True, False, 1, False, "float16"),  # past 128: phase 11 alone, 2 column parts
]


@needs_compiler
def test_backward_plan_launches_what_backward_run_launches():
    """runtime/backward.py's plan packs, for every launch, the bytes Numba packs for Backward.run's
    launch of the same buffers: the same kernel, grid, block, shared memory and disk-cache entry, and
    every parameter, pointers included, so each buffer lands where run() puts it; run()'s zeroing
    kernel and the plan's memset cover the same words. No GPU: run() is recorded, not launched."""
    from numba.cuda import types
    from numba.cuda.core import sigutils

    from flashcore_numba.phases import backward_phase, p11_backward
    from flashcore_numba.runtime.backward import backward_launches

    from flashcore_numba.arch import tma

    # phase 12: phase 11's Backward, its kv_kernel on wgmma; phase 13: and its tensor maps (here a
    # host array in place of Backward.run's device copy: the plan writes the pointer the call passes)
    for (q_shape, k_shape, causal, deterministic, parts, with_dlse, dtype), phase in itertools.product(
            BACKWARD_PLAN_CASES, ("11", "12", "13")):
        if not backward_phase(phase).runs_head_dim(q_shape[3]):
            continue
        bw = backward_phase(phase).build(q_shape[3], dtype, cc=(9, 0))
        views = backward_phase(phase).kernel_views(q_shape[3], dtype, cc=(9, 0))
        e = np.float16 if dtype == "float16" else np.int16
        stats = np.zeros(q_shape[:3], np.float32)
        buffers = {"q": np.zeros(q_shape, e), "k": np.zeros(k_shape, e), "v": np.zeros(k_shape, e),
                   "out": np.zeros(q_shape, e), "dout": np.zeros(q_shape, e), "lse": stats, "dlse": stats.copy(),
                   "delta": stats.copy(), "dq": np.zeros(q_shape, np.float32), "dk": np.zeros(k_shape, e),
                   "dv": np.zeros(k_shape, e), "sums": np.zeros((parts, *q_shape), np.float32)}
        if parts == 1:
            buffers["sums"] = buffers["dq"]
        buffers["maps"] = np.zeros((4, 16), np.uint64)
        recorded = []

        def record(kernel, grid, block, smem, args, stream=0, cache_key=()):
            recorded.append((kernel, tuple(grid) if isinstance(grid, tuple) else (grid, 1, 1), block, smem, args,
                             cache_key))

        b = buffers
        mp = pytest.MonkeyPatch()
        mp.setattr(p11_backward, "launch", record)
        mp.setattr(tma, "head_maps", lambda arrays, box: buffers["maps"])
        try:
            bw.run(b["q"], b["k"], b["v"], b["out"], b["dout"], b["lse"], b["dq"], b["dk"], b["dv"], causal, 0.3,
                   deterministic, dLSE=b["dlse"] if with_dlse else None, delta=b["delta"],
                   dq_sums=b["sums"] if parts > 1 else None, parts=parts)
        finally:
            mp.undo()
        zeroing, launched = recorded[1], [recorded[0], *recorded[2:]]  # Δ, dQ zeroed, kv_kernel, the sum
        assert zeroing[0] is p11_backward._zero_kernel
        flat = zeroing[4][0]
        assert flat.ctypes.data == b["sums"].ctypes.data and flat.size == parts * int(np.prod(q_shape))
        plan = backward_launches(bw, q_shape, k_shape, causal, 0.3, deterministic, parts, with_dlse)
        assert [planned.kernel_id for planned in plan] == ["11-delta", f"{phase}-kv-serial" if deterministic
                                                         else f"{phase}-kv", *(["11-sum"] if parts > 1 else [])]
        assert len(plan) == len(launched)
        for planned, (kernel, grid, block, smem, args, cache_key) in zip(plan, launched, strict=True):
            view = views[planned.kernel_id]
            assert kernel is view.kernel and cache_key == bw.cache_id(planned.kernel_id), planned.kernel_id
            assert (planned.grid + (1, 1))[:3] == grid and (planned.block, planned.smem) == (block, smem), planned.kernel_id
            slots = ArgSlots(planned.args)
            for i, name in planned.pointers():
                slots.set_pointer(i, buffers[name].ctypes.data)
            argtypes, _ = sigutils.normalize_signature(view.types)
            numba = numba_packed(argtypes, [np.float32(a) if t == types.float32 else a for t, a in zip(argtypes, args)])
            ours = [int(x).to_bytes(8, "little") for x in slots.values()]
            assert len(ours) == len(numba) == len(slots.sizes), planned.kernel_id
            for i, (x, y, size) in enumerate(zip(ours, numba, slots.sizes, strict=True)):
                assert x[:size] == y[:size], f"{planned.kernel_id} parameter {i}: ours {x[:size].hex()}, numba's {y[:size].hex()}"


def test_compile_caches_what_every_entry_point_launches(monkeypatch):
    """`flashcore compile` fills the cache for attention_kvcache (paged and contiguous),
    attention_varlen (07 and 09), phase 09's trace build and the backward too: what each launches
    (recorded in the simulator, not run) is the kernel, argument types and cache identity that
    compiling its id stores (runtime/precompile.py), so a new process loads it; the backward's plan looks up kernels that compiling "11" stores."""
    import numba
    from numba import cuda
    from numba.cuda.core import sigutils

    from flashcore_numba import inference
    from flashcore_numba.phases import backward_phase
    from flashcore_numba.runtime import precompile
    from flashcore_numba.runtime.backward import backward_launches

    items = precompile.kernels_to_compile(precompile.kernel_ids(), (64, 128), ("float16", "bfloat16"))
    for extra in ("10-kvcache", "07-varlen", "09-varlen", "11", "12", "09-trace"):
        assert {(extra, 64, "float16"), (extra, 128, "bfloat16")} <= set(items), extra
    recorded = []
    monkeypatch.setattr(inference, "launch_kernel", lambda kernel, grid, block, smem, args, stream=0,
                        cache_key=(): recorded.append((kernel, args, cache_key)))
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 4, 64)).astype(np.float16)
    pages = rng.standard_normal((4, 16, 2, 64)).astype(np.float16)
    inference.attention_kvcache(q, pages, pages, np.array([20, 5], np.int32), np.array([[0, 1], [2, 3]], np.int32))
    inference.attention_kvcache(q, pages[:2], pages[:2], np.array([16, 0], np.int32))  # contiguous
    packed = rng.standard_normal((30, 4, 64)).astype(np.float16)
    offsets = np.array([0, 10, 30], np.int32)
    for phase in ("07", "09"):
        inference.attention_varlen(packed, packed[:, :2].copy(), packed[:, :2].copy(), offsets, offsets, 20, 20,
                                   phase=phase)
    from flashcore_numba.measure import trace
    from flashcore_numba.phases import common

    monkeypatch.setattr(common, "launch", lambda kernel, grid, block, smem, args, stream=0,
                        cache_key=(): recorded.append((kernel, args, cache_key)))
    config = trace.trace_config(64)
    qkv = [cuda.to_device(x) for x in (q.transpose(0, 2, 1, 3).copy(),) * 3]
    trace.launch_with_trace(config, trace.trace_array(config, qkv[0].shape, True), *qkv,
                            cuda.to_device(np.zeros(qkv[0].shape, np.float16)), True, 0.1)
    launched_ids = [key[0] for _, _, key in recorded]
    assert launched_ids == ["10-kvcache", "10-kvcache", "07-varlen", "09-varlen", "09-trace"]

    def device_type(a):
        """The Numba type of an argument as a GPU launch types it: the simulator's arrays wrap NumPy's,
        whose flags call a dimension of size 1 and stride 0 contiguous; a device array calls any zero
        stride a broadcast, not contiguous (numba-cuda's dummyarray._compute_layout)."""
        a = getattr(a, "_ary", a)
        t = numba.typeof(a)
        if isinstance(a, np.ndarray) and a.ndim and a.size and 0 in a.strides:
            t = t.copy(layout="A")
        return t

    for kernel, args, key in recorded:
        stored = {identity: (compiled, signature)
                  for compiled, signature, identity in precompile.kernels_of(*key, (9, 0))}
        compiled, signature = stored[key]
        argtypes, _ = sigutils.normalize_signature(signature)
        launched = tuple(device_type(a) for a in args)
        assert compiled is kernel and launched == tuple(argtypes), (key, launched)
    # "10-kvcache" stores both builds KVCachePlan picks from (p10.batch_fills_gpu)
    assert [identity[0] for _, _, identity in precompile.kernels_of("10-kvcache", 64, "float16", (9, 0))] == [
        "10-kvcache", "10-batch-kvcache"]
    for dtype, phase in itertools.product(("float16", "bfloat16"), ("11", "12")):
        bw = backward_phase(phase).build(64, dtype, cc=(9, 0))
        stored = {identity: (kernel, signature) for kernel, signature, identity in
                  precompile.kernels_of(phase, 64, dtype, (9, 0))}
        views = backward_phase(phase).kernel_views(64, dtype, cc=(9, 0))
        for deterministic, parts in ((False, 1), (True, 4)):
            for planned in backward_launches(bw, (1, 4, 100, 64), (1, 2, 100, 64), True, 0.1, deterministic, parts,
                                             False):
                view = views[planned.kernel_id]
                assert stored[bw.cache_id(planned.kernel_id)] == (view.kernel, view.types), planned.kernel_id
    assert precompile.kernels_of("12", 64, "float16", (8, 0)) == []  # wgmma: nothing to compile for an A100


def _phase01():
    """Phase 01 at D=64 as the registry builds it (its cache key), and its argument types."""
    from numba.cuda.core import sigutils

    from flashcore_numba.phases import PHASES, build

    config = build(PHASES["01"], 64)
    argtypes, _ = sigutils.normalize_signature(config.signature())
    return config, argtypes


@needs_compiler
def test_cache_keeps_phase_14s_kernel_of_a_users_mods(tmp_path, monkeypatch):
    """Phase 14's kernel with mods compiled in, its bound arrays tuples of arrays among its arguments:
    cached under its mods' fingerprints, loaded by the next call; another mod is another entry."""
    from numba.cuda import types

    from flashcore_numba import flex
    from flashcore_numba.phases import p14_flex

    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FLASHCORE_CACHE", raising=False)
    score, mask = flex.softcap(30.0), flex.sliding_window(64)
    config = p14_flex.build(64, "float16", score.fn, 1, mask.fn, 1)
    identity = p14_flex.cache_identity(64, "float16", score, mask)
    assert identity[:3] == ("14", 64, "float16") and len(identity) == 5
    a4 = types.Array(types.float16, 4, "C")
    argtypes = (a4, a4, a4, types.Array(types.uint32, 4, "C"), types.Array(types.float32, 3, "C"), types.float32,
                types.Array(types.int32, 3, "C"), types.Array(types.int32, 4, "C"), types.Array(types.int8, 4, "C"),
                types.Tuple([types.Array(types.float32, 1, "C")]), types.Tuple([types.Array(types.int32, 1, "C")]))
    first = cache.cached_cubin(config.kernel, argtypes, identity, (9, 0))
    again = cache.cached_cubin(config.kernel, argtypes, identity, (9, 0))
    assert first.built and not again.built and again.cubin == first.cubin and len(list(tmp_path.glob("*.cubin"))) == 1
    other = p14_flex.cache_identity(64, "float16", flex.alibi(np.ones(2, np.float32)), mask)
    assert other != identity and other[4] == identity[4]


@needs_compiler
def test_cache_stores_loads_and_rebuilds_a_bad_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FLASHCORE_CACHE", raising=False)
    config, argtypes = _phase01()
    assert config.cache_key == ("01", 64, "float16")

    def cached():
        return cache.cached_cubin(config.kernel, argtypes, config.cache_key, (9, 0))

    before = dict(cache.stats)
    first = cached()
    assert first.built and cache.stats["built"] == before["built"] + 1
    (entry,) = tmp_path.glob("*.cubin")
    assert entry.name == f"{first.key}.cubin" and launch.kernel_names(first.cubin) == [first.entry]
    # the arguments of phase 01 (Q, K, V, O, causal, qk_scale) are what the kernel declares
    shape = (1, 2, 40, 64)
    ArgSlots([ArrayArg(shape, 2)] * 4 + [ScalarArg("bool", False), ScalarArg("float32", 0.2)]).check(
        first.cubin, first.entry)
    with pytest.raises(ValueError, match="do not match the compiled kernel"):
        ArgSlots([ArrayArg(shape, 2)] * 4 + [ScalarArg("bool", False)]).check(first.cubin, first.entry)

    again = cached()
    assert not again.built and again.cubin == first.cubin and again.entry == first.entry
    assert cache.stats["loaded"] == before["loaded"] + 1

    good = entry.read_bytes()
    corruptions = {
        "truncated": good[:-100],
        "a flipped byte": good[:-50] + bytes([good[-50] ^ 0xFF]) + good[-49:],
        "another key's header": good.replace(first.key.encode(), b"0" * len(first.key)),
        "not an entry at all": b"garbage",
        "empty": b"",
    }
    for what, data in corruptions.items():
        entry.write_bytes(data)
        rejected = cache.stats["rejected"]
        rebuilt = cached()
        assert rebuilt.built and cache.stats["rejected"] == rejected + 1, what
        # written again, whole (the entry name, hence the bytes, carry a count of Numba's compiles)
        assert cache.read_entry(entry, first.key) == (rebuilt.cubin, rebuilt.entry), what
    assert [p.name for p in tmp_path.iterdir()] == [entry.name]  # no temporary file left behind


def test_a_copy_of_a_phase_never_loads_the_phase_s_cubin(tmp_path, monkeypatch):
    """An exercise being solved declares the same cache identity as its phase (phase 11's
    Backward.cache_id is in the stub too), but the key hashes the package's source, not the
    copy's: were it cached, the stub would load the solution's kernel and pass every GPU check."""
    from flashcore_numba.course.student import load_module
    from flashcore_numba.phases import p11_backward

    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FLASHCORE_CACHE", raising=False)
    stub = load_module(Path(__file__).resolve().parents[1] / "lessons" / "exercises" / "11_backward.py")
    assert cache.is_ours(p11_backward._sum_parts_kernel) and cache.is_ours(p11_backward.build(64).kv_kernel)
    assert not cache.is_ours(stub._sum_parts_kernel) and not cache.is_ours(stub.build(64).kv_kernel)

    monkeypatch.setattr(cache, "toolchain", lambda: {"numba-cuda": "0.30.4", "nvvm": "2.0", "nvjitlink": "13.5"})
    compiled = []
    monkeypatch.setattr(launch, "build_cubin", lambda d, a, cc: compiled.append(d) or (b"cubin of %d" % len(compiled), "e"))
    identity = p11_backward.build(64).cache_id("11-sum")
    assert stub.build(64).cache_id("11-sum") == identity
    ours = cache.cached_cubin(p11_backward._sum_parts_kernel, ("f32",), identity, (9, 0))
    assert ours.built and len(list(tmp_path.glob("*.cubin"))) == 1
    theirs = cache.cached_cubin(stub._sum_parts_kernel, ("f32",), identity, (9, 0))
    assert theirs.built and theirs.cubin != ours.cubin and compiled == [p11_backward._sum_parts_kernel, stub._sum_parts_kernel]
    assert len(list(tmp_path.glob("*.cubin"))) == 1  # the copy's kernel is not stored either
    assert not cache.cached_cubin(p11_backward._sum_parts_kernel, ("f32",), identity, (9, 0)).built


def test_cache_key_names_everything_that_changes_the_code(monkeypatch):
    monkeypatch.setattr(cache, "toolchain", lambda: {"numba-cuda": "0.30.4", "nvvm": "2.0", "nvjitlink": "13.5"})
    base = cache.key_fields(("09", 64, "float16"), ("f16[:,::1]",), (9, 0))
    key = cache.key_of(base)
    others = [cache.key_fields(("09-ws", 64, "float16"), ("f16[:,::1]",), (9, 0)),
              cache.key_fields(("09", 128, "float16"), ("f16[:,::1]",), (9, 0)),
              cache.key_fields(("09", 64, "bfloat16"), ("f16[:,::1]",), (9, 0)),
              cache.key_fields(("09", 64, "float16"), ("f16[:,:]",), (9, 0)),
              cache.key_fields(("09", 64, "float16"), ("f16[:,::1]",), (10, 0)),
              dict(base, source="another"), dict(base, toolchain={"nvjitlink": "13.0"})]
    assert len({key, *map(cache.key_of, others)}) == 1 + len(others)
    assert base["source"] == cache.source_fingerprint() and len(base["source"]) == 64


def test_a_kernels_key_hashes_the_modules_that_make_it_not_every_phase(tmp_path, monkeypatch):
    """An edit to phase 11 compiles phase 11's kernels again, not the forward's: a kernel's source
    is its phase's module, the file that defines it and what those import (arch/cache.py,
    kernel_source), never a phase they do not import. Phase 04's kernel is defined in phase 03's
    builder, and phase 04's constants reach it as arguments: both files count. An id without a
    phase number counts every file. And cached_cubin keys each kernel by its own source."""
    from flashcore_numba.arch.ptx import ptx_dir
    from flashcore_numba.phases import build, get_phase, p11_backward

    def files(kernel_id, kernel):
        return {p.name if p.suffix == ".ptx" else p.relative_to(cache.PACKAGE).as_posix()
                for p in cache.kernel_source(kernel_id, kernel.py_func.__code__.co_filename)}

    ptx = {p.name for p in ptx_dir().glob("*.ptx")}
    backward = files("11-kv", p11_backward.build(64).kv_kernel)
    assert {"phases/p11_backward.py", "phases/p07_mma_sync.py", "phases/common.py", "phases/__init__.py",
            "arch/__init__.py", "arch/operands.py", "arch/ptx.py", "arch/sim.py"} | ptx <= backward
    assert not any(f.startswith(("phases/p08", "phases/p09", "phases/p10")) for f in backward)
    p04 = build(get_phase("04"), 64).kernel
    assert p04.py_func.__code__.co_filename.endswith("p03_warp_shuffle.py")
    assert {"phases/p03_warp_shuffle.py", "phases/p04_padding.py"} <= files("04", p04)
    assert "phases/p11_backward.py" not in files("09", build(get_phase("09"), 64).kernel)
    every = files("xx", p04)
    assert ptx <= every and "phases/p11_backward.py" in every and "phases/p09_warp_specialized.py" in every

    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FLASHCORE_CACHE", raising=False)
    monkeypatch.setattr(cache, "toolchain", lambda: {"nvjitlink": "13.5"})
    monkeypatch.setattr(launch, "build_cubin", lambda d, a, cc: (b"cubin", "e"))
    kv = p11_backward.build(64).kv_kernel
    entry = cache.cached_cubin(kv, ("f32",), ("11-kv", 64, "float16"), (9, 0))
    source = cache.kernel_fingerprint("11-kv", kv.py_func.__code__.co_filename)
    assert entry.key == cache.key_of(cache.key_fields(("11-kv", 64, "float16"), ("f32",), (9, 0), source))
    p09 = build(get_phase("09"), 64).kernel
    assert source != cache.source_fingerprint()
    assert source != cache.kernel_fingerprint("09", p09.py_func.__code__.co_filename)


def test_cache_folder_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("FLASHCORE_CACHE", raising=False)
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path / "kernels"))
    assert cache.cache_dir() == tmp_path / "kernels"
    monkeypatch.delenv("FLASHCORE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    if sys.platform.startswith("linux"):
        assert cache.cache_dir() == tmp_path / "flashcore-numba"
    monkeypatch.setenv("FLASHCORE_CACHE", "0")
    assert cache.cache_dir() is None


@needs_compiler
def test_backward_built_for_sm80_adds_one_float_per_reduction():
    """sm_80 has no vector red: phase 11's kv_kernel built for compute capability 8.0 adds dQ one
    float per instruction (ptx/red.ptx's flashcore_red_add_f32), and its PTX assembles for sm_80
    (tests/test_backward.py checks the sm_90a build's pairs)."""
    from numba import cuda

    from flashcore_numba.measure.machine_code import assemble
    from flashcore_numba.phases import p11_backward

    view = p11_backward.kernel_views(64)["11-kv"]
    ptx, _ = cuda.compile_ptx(p11_backward.build(64, cc=(8, 0)).kv_kernel.py_func, view.types, cc=(8, 0))
    assert "red.global.add.f32" in ptx and ".v2.f32" not in ptx and "atom.global" not in ptx
    assemble(ptx, arch="sm_80")


@needs_compiler
def test_cache_switched_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLASHCORE_CACHE", "0")
    config, argtypes = _phase01()
    assert cache.cached_cubin(config.kernel, argtypes, config.cache_key, (9, 0)).built
    assert not list(tmp_path.iterdir())


def test_torch_compile_traces_attention_as_one_op():
    """torch.compile(fullgraph=True) of a function that calls attention() traces it as the custom op
    flashcore::attention (its fake implementation gives the output's shape and dtype): no graph
    break. The captured graph is not run here (no GPU); tests/test_gpu.py runs it against eager."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import attention

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return lambda *args: (torch.empty(2, 4, 16, 64),)  # the graph's output, not computed

    def model(q, k, v):
        return attention(q, k, v, causal=True) * 2

    q, k, v = (torch.randn(2, 4, 16, 64) for _ in range(3))
    out = torch.compile(model, fullgraph=True, backend=capture)(q, k, v)
    assert out.shape == (2, 4, 16, 64)
    (graph,) = graphs
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert "flashcore.attention.default" in targets, targets
    node = next(n for n in graph.graph.nodes if str(n.target) == "flashcore.attention.default")
    assert node.args[3:] == (True, None, "best")  # causal, scale, phase


def test_a_call_finds_its_plan_by_its_key(monkeypatch):
    """attention() on torch tensors makes a problem's plan once (validating it then) and finds it again
    by the call's key; another shape, flag or dtype is another plan; an unhashable argument is named;
    and the table forgets its oldest plans past the number it keeps. Run with CPU tensors and a stand-in plan
    (no GPU here): what is tested is the lookup, not the launch."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import api

    made, launched = [], []

    class StandInPlan:
        device_index = 0
        out_shape = None  # the output is q's shape

        def __call__(self, q, k, v, out, stream, lse=None):
            launched.append(out.shape)
            if lse is not None:
                lse.fill_(1.0)

    def make_plan(q, k, v, causal, scale, phase, return_lse=False):
        made.append((tuple(q.shape), causal, scale, phase, return_lse))
        return StandInPlan()

    monkeypatch.setattr(api, "make_plan", make_plan)
    monkeypatch.setattr(api, "current_stream", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(api, "_PLANS", Plans())
    q, k, v = (torch.zeros(1, 2, 8, 64, dtype=torch.float16) for _ in range(3))
    for _ in range(3):
        out = api.attention(q, k, v, causal=True)
    assert len(made) == 1 and len(launched) == 3 and out.shape == q.shape and out.dtype == q.dtype
    api.attention(q, k, v)  # another flag
    api.attention(q[:, :, :4], k, v)  # another shape (a view: not contiguous, so another key too)
    api.attention(q.float(), k.float(), v.float())  # another dtype
    assert len(made) == 4
    out, lse = api.attention(q, k, v, causal=True, return_lse=True)  # another plan: it writes the LSE
    assert len(made) == 5 and made[-1][4] is True
    assert lse.shape == (1, 2, 8) and lse.dtype == torch.float32 and bool((lse == 1.0).all())
    with pytest.raises(TypeError, match="phase: expected a phase id"):
        api.attention(q, k, v, phase=["09"])  # unhashable: the validation says what is wrong
    api._PLANS.kept = 2
    api.attention(q, k, v, scale=0.5)
    assert len(api._PLANS) == 2 and made[-1][2] == 0.5


def test_a_backward_finds_its_plan_by_its_problem(monkeypatch):
    """attention()'s backward (torch_ops.attention_backward) makes a problem's BackwardPlan once and finds it again;
    another flag, or another backward phase (phase 12's kv_kernel), is another plan; the plan gets every
    buffer in the inputs' dtype and contiguous, and a (parts, *q.shape) float32 buffer where it sums dQ
    in parts; an empty sequence gives zeros with no plan. CPU tensors and a stand-in plan (no GPU
    here): what is tested is the call, not the launch."""
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    from flashcore_numba import runtime
    from flashcore_numba.runtime import torch_ops

    made, calls = [], []

    class StandInPlan:
        def __init__(self, head_dim, dtype, q_shape, k_shape, causal, scale, deterministic, with_dlse, device,
                     phase):
            made.append((head_dim, dtype, q_shape, k_shape, causal, scale, deterministic, with_dlse, device, phase))
            self.parts = 3 if deterministic else 1

        def __call__(self, q, k, v, out, dout, lse, dq, dk, dv, delta, stream, dq_sums=None, dlse=None):
            calls.append((q.dtype, dout.is_contiguous(), lse.dtype, None if dq_sums is None else tuple(dq_sums.shape),
                          dlse is not None))
            dq.fill_(1.0)
            dk.fill_(2.0)
            dv.fill_(3.0)

    monkeypatch.setattr(runtime, "BackwardPlan", StandInPlan)
    monkeypatch.setattr(torch_ops, "current_stream", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch_ops, "_BACKWARD_PLANS", Plans())
    monkeypatch.setattr(torch_ops, "_AUTOGRAD_BACKWARD", {})
    asked = []  # the devices whose capability autograd's choice of backward asked for
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: asked.append(index) or (8, 0))
    q = torch.zeros(1, 2, 8, 64, dtype=torch.float16)
    k = v = torch.zeros(1, 1, 9, 64, dtype=torch.float16)
    lse = torch.zeros(1, 2, 8)
    dout = torch.zeros(1, 2, 64, 8, dtype=torch.float32).transpose(2, 3)  # another dtype, not contiguous
    for _ in range(2):
        dq, dk, dv = torch_ops.attention_backward(q, k, v, q, lse, dout, None, True, 0.125, False)
    assert len(made) == 1 and made[0] == (64, "float16", (1, 2, 8, 64), (1, 1, 9, 64), True, 0.125, False, False, 0,
                                          "11")
    assert calls[-1] == (torch.float16, True, torch.float32, None, False)
    assert dq.dtype == torch.float16 and bool((dq == 1).all() and (dk == 2).all() and (dv == 3).all())
    torch_ops.attention_backward(q, k, v, q, lse, dout, lse, True, 0.125, True)  # deterministic, with the LSE's gradient
    assert len(made) == 2 and calls[-1] == (torch.float16, True, torch.float32, (3, 1, 2, 8, 64), True)
    # autograd's backward phase, chosen once per device and head dim for each of deterministic's two
    # values (an sm_80 GPU: 11 for both)
    assert asked == [0, 0], asked
    torch_ops.attention_backward(q, k, v, q, lse, dout, None, True, 0.125, False, "12")
    assert len(made) == 3 and made[-1][-1] == "12"
    empty = torch.zeros(1, 1, 0, 64, dtype=torch.float16)
    dq, dk, dv = torch_ops.attention_backward(q, empty, empty, q, lse, dout, None, False, 0.125, False)
    assert len(made) == 3 and not dq.any() and dk.shape == empty.shape
    # on Hopper autograd runs phase 13's backward, phase 12's when deterministic
    monkeypatch.setattr(torch_ops, "_AUTOGRAD_BACKWARD", {})
    monkeypatch.setattr(torch_ops, "_BACKWARD_PLANS", Plans())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    torch_ops.attention_backward(q, k, v, q, lse, dout, None, True, 0.125, False)
    assert len(made) == 4 and made[-1][-1] == "13"
    torch_ops.attention_backward(q, k, v, q, lse, dout, None, True, 0.125, True)
    assert len(made) == 5 and made[-1][-2:] == (0, "12") and made[-1][6] is True


def test_autograd_runs_the_wgmma_backwards_on_hopper_only():
    """wgmma exists on sm_90 alone: Hopper gets phase 13's backward up to D = 128 (phase 12's serial
    build when deterministic, level with 13's or ahead in the records), every other GPU and every
    head dim past 128 phase 11's (which splits the gradients' columns there)."""
    from flashcore_numba.runtime import torch_ops

    assert torch_ops.autograd_backward_phase((9, 0)) == "13"
    assert torch_ops.autograd_backward_phase((9, 0), 128, deterministic=True) == "12"
    assert [torch_ops.autograd_backward_phase((9, 0), D) for D in (8, 96, 128, 136, 192, 256)] == \
        ["13"] * 3 + ["11"] * 3
    assert [torch_ops.autograd_backward_phase((9, 0), D, True) for D in (8, 136)] == ["12", "11"]
    assert [torch_ops.autograd_backward_phase(cc) for cc in ((8, 0), (8, 6), (8, 9), (10, 0), (12, 0))] == ["11"] * 5


def test_torch_compile_traces_a_call_that_needs_gradients_as_the_training_op():
    """In a new process whose eager calls never ran the ops: torch.compile(fullgraph=True) of a
    function that calls attention() on tensors that require grad traces flashcore::attention_train
    (registered when torch was imported: an op cannot be registered while torch.compile traces). No
    GPU: the captured graph is inspected, not run; tests/test_backward.py runs it on a GPU."""
    pytest.importorskip("torch", reason=NO_TORCH)
    script = (
        "import torch, flashcore_numba\n"
        "from flashcore_numba import attention\n"
        "graphs = []\n"
        "def capture(gm, example_inputs):\n"
        "    graphs.append(gm)\n"
        "    return gm.forward\n"
        "q, k, v = (torch.randn(1, 2, 16, 64, requires_grad=True) for _ in range(3))\n"
        "try:\n"
        "    torch.compile(lambda q, k, v: attention(q, k, v, causal=True) * 2, fullgraph=True,\n"
        "                  backend=capture)(q, k, v)\n"
        "except Exception:\n"
        "    pass  # running the captured graph needs a GPU; the trace is what is checked\n"
        "print(sorted({str(n.target) for g in graphs for n in g.graph.nodes if n.op == 'call_function'}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "flashcore.attention_train.default" in done.stdout, done.stdout + done.stderr[-2000:]


def test_the_grader_keys_the_package_s_kernels_and_only_those():
    """A speed check's baseline, and a solution graded from the package's own file, load from the
    disk cache (their configs carry the phase's cache key); a student's module compiles in its
    grader, even where its kernel is a package function."""
    from flashcore_numba.course.grade import keyed_build
    from flashcore_numba.course.student import load_module
    from flashcore_numba.phases import PHASES

    root = Path(__file__).resolve().parents[1]
    assert keyed_build(PHASES["07"], 64).cache_key == ("07", 64, "float16")
    solution = load_module(root / "flashcore_numba" / "phases" / "p03_warp_shuffle.py")
    assert keyed_build(solution, 64).cache_key == ("03", 64, "float16")
    stub = load_module(root / "lessons" / "exercises" / "03_warp_shuffle.py")
    assert keyed_build(stub, 64).cache_key == ()
    # exercise 04 builds phase 03's kernel (a package function) with the student's own padding: it
    # must never load (or write) phase 04's cubin
    stub04 = load_module(root / "lessons" / "exercises" / "04_padding.py")
    assert cache.is_ours(stub04.build(64).kernel) and keyed_build(stub04, 64).cache_key == ()


def test_a_gpu_session_notes_each_kernel_numba_compiles():
    """conftest.watch_compiles (GPU sessions): a kernel compiled for new argument types is noted
    once, with its name and file; one Numba already holds is not; compile's result is untouched."""
    from numba import types

    import conftest

    def attention_kernel(x):
        pass

    class Dispatcher:  # what watch_compiles reads of numba-cuda's CUDADispatcher
        specialized = False
        py_func = attention_kernel

        def __init__(self):
            self.overloads = {}

        def compile(self, sig):
            self.overloads[tuple(sig)] = "kernel"
            return "kernel"

    noted = []
    conftest.watch_compiles(Dispatcher, noted)
    d, sig = Dispatcher(), (types.float32[::1],)
    assert d.compile(sig) == "kernel" and d.compile(sig) == "kernel"
    assert len(noted) == 1 and noted[0][0].startswith("test_a_gpu_session_notes_each_kernel_numba_compiles.")
    assert "tests/test_runtime.py" in noted[0][0]


@pytest.mark.gpu
def test_numpy_and_numba_arrays_launch_through_plans_on_a_gpu(monkeypatch):
    """On a GPU every entry point launches through runtime/'s plans, NumPy and Numba device arrays
    included: Numba's launch (phases/common.launch and KernelConfig.launch) is the simulator's alone,
    so here it raises. attention() (phases 03, 07 and, on Hopper, 09 with its tensor maps; a Numba
    array in, a Numba array out), attention_kvcache (paged and contiguous) and attention_varlen (07,
    09), each against the float64 reference; a second call finds its plan."""
    from numba import cuda
    from test_inference import check as check_kvcache
    from test_inference import make_cache
    from test_varlen import check as check_varlen
    from test_varlen import packed

    from flashcore_numba import api, attention, check_close, inference
    from flashcore_numba.phases import common
    from flashcore_numba.reference import lowp_attention, reference_attention

    def numba_launch(*args, **kwargs):
        raise AssertionError("a launch through Numba's dispatcher on a GPU")

    monkeypatch.setattr(common, "launch", numba_launch)
    monkeypatch.setattr(inference, "launch_kernel", numba_launch)
    monkeypatch.setattr(common.KernelConfig, "launch", numba_launch)
    hopper = tuple(cuda.get_current_device().compute_capability) == (9, 0)
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((2, 4, 150, 64)).astype(np.float16) for _ in range(3))
    ref, lowp = reference_attention(q, k, v, causal=True), lowp_attention(q, k, v, causal=True)
    for phase in ("03", "07", *(("09",) if hopper else ())):
        for _ in range(2):
            verdict = check_close(attention(q, k, v, causal=True, phase=phase), ref, lowp)
            assert verdict.ok, f"phase {phase}: {verdict.message}"
    plans = len(api._ARRAY_PLANS)
    out = attention(*(cuda.to_device(x) for x in (q, k, v)), causal=True, phase="07")
    assert cuda.is_cuda_array(out) and check_close(out.copy_to_host(), ref, lowp).ok
    assert len(api._ARRAY_PLANS) == plans  # the same problem: the NumPy call's plan
    check_kvcache(*make_cache(B=3, S_q=1, H=4, H_kv=2, D=64, lengths=[70, 1, 33]))
    check_kvcache(*make_cache(B=2, S_q=3, H=4, H_kv=1, D=128, lengths=[500, 0], page_size=64))
    for phase in ("07", *(("09",) if hopper else ())):
        check_varlen(*packed([100, 0, 37, 260]), causal=True, phase=phase)
