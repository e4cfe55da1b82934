"""The trace build of a warp-specialized kernel: every barrier wait timed by the GPU's clock.

Phase 09's warpgroups wait on mbarriers (a K/V stage has landed, a stage is free again, Q has
landed, Q may be reloaded) and on named barriers (the consumers' turns). When a launch is slow,
the question is which wait took the time. `wait_hooks` hands the kernel its two wait functions
and two marks; in the plain build the waits are the PTX functions themselves and the marks
compile to nothing, so the kernel is unchanged instruction for instruction. Built with
`Build(trace=True)`, each wait reads %globaltimer (ptx/trace.ptx) before and after, and the first thread
of each warpgroup (a *role*: the producer, then each consumer) keeps a record in shared memory
behind the kernel's own:

    word 0, 1, 2   start, after setmaxnreg, end (low 32 bits of %globaltimer, ns)
    word 3         query blocks the role took; word 4: events kept
    words 8 ..     per kind of wait (full, empty, q_full, q_empty, named barrier): total ns, count, longest
    then           up to TRACE_EVENTS waits longer than TRACE_EVENT_NS, 4 words each: when (ns after the
                   start), how long, which barrier (index | parity << 8; named barrier id | 0x10000),
                   in which of the role's query blocks

When its block ends each role copies its record to the trace array the kernel gets in place of
its work counter, after the counter's own word. flashcore_numba.measure.trace launches the build
and reads the records; tools/stalls.py times many launches (docs/tuning/09_history.md).
"""

from __future__ import annotations

from numba import cuda, int32, uint32

from ..arch import operands, ptx
from .common import uidx

TRACE_HEADER, TRACE_KINDS, TRACE_EVENTS, TRACE_EVENT_NS = 8, 5, 12, 50_000
TRACE_WORDS = TRACE_HEADER + 3 * TRACE_KINDS + 4 * TRACE_EVENTS


def wait_hooks(raw_wait, raw_bar_sync, trace: bool, smem_bytes: int, bars_off: int, stages: int, consumers: int):
    """(wait, bar_sync, mark, save, shared-memory bytes) for a kernel whose shared memory holds
    `smem_bytes`, its mbarriers at `bars_off`: full[stages], empty[stages], q_full[consumers],
    q_empty[consumers]. Roles are warpgroups: warpgroup r (threads 128 r ..) keeps record r."""
    roles = 1 + consumers
    record0 = (smem_bytes + 3) // 4  # the first record, in words of the dynamic shared memory

    if not trace:
        @cuda.jit(device=True, inline=True)
        def mark(field):
            pass

        @cuda.jit(device=True, inline=True)
        def save(counter):
            pass

        return raw_wait, raw_bar_sync, mark, save, smem_bytes

    clock = ptx.function("trace.ptx", "flashcore_globaltimer_lo", "inline")

    @cuda.jit(device=True, inline=True)
    def record(role, kind, code, t0, dt):
        """Add a wait of dt ns (begun at t0) of `kind` to this role's record; keep it as an event
        when it took longer than TRACE_EVENT_NS."""
        sm = cuda.shared.array(0, uint32, alignment=1024)
        base = uidx(record0 + role * TRACE_WORDS)
        k = base + uidx(TRACE_HEADER + 3 * kind)
        sm[k] += dt
        sm[k + uidx(1)] += uint32(1)
        sm[k + uidx(2)] = max(sm[k + uidx(2)], dt)
        n = sm[base + uidx(4)]
        if dt > uint32(TRACE_EVENT_NS) and n < uint32(TRACE_EVENTS):
            e = base + uidx(TRACE_HEADER + 3 * TRACE_KINDS + 4 * n)
            sm[e] = t0 - sm[base]
            sm[e + uidx(1)] = dt
            sm[e + uidx(2)] = code
            sm[e + uidx(3)] = sm[base + uidx(3)]
            sm[base + uidx(4)] = n + uint32(1)

    @cuda.jit(device=True, inline=True)
    def mark(field):
        """Header word `field` of this role's record: 0 the start (the record zeroed first), 1 after
        setmaxnreg, 2 the end; 3 counts one more query block."""
        tid = cuda.threadIdx.x
        if tid % 128 == 0:
            sm = cuda.shared.array(0, uint32, alignment=1024)
            base = uidx(record0 + (tid // 128) * TRACE_WORDS)
            if field == 0:
                for i in range(TRACE_WORDS):
                    sm[base + uidx(i)] = uint32(0)
            if field == 3:
                sm[base + uidx(3)] += uint32(1)
            else:
                sm[base + uidx(field)] = clock()

    @cuda.jit(device=True, inline=True)
    def save(counter):
        """The end mark, then this role's record to the trace array (int32 words, after the counter)."""
        tid = cuda.threadIdx.x
        if tid % 128 == 0:
            mark(2)
            sm = cuda.shared.array(0, uint32, alignment=1024)
            role = tid // 128
            base = uidx(record0 + role * TRACE_WORDS)
            out = uidx(1 + (cuda.blockIdx.x * roles + role) * TRACE_WORDS)
            for i in range(TRACE_WORDS):
                counter[out + uidx(i)] = int32(sm[base + uidx(i)])

    @cuda.jit(device=True, inline=True)
    def wait(bar, parity):
        """raw_wait, timed: its kind from the barrier's place in shared memory."""
        t0 = clock()
        raw_wait(bar, parity)
        dt = clock() - t0
        tid = cuda.threadIdx.x
        if tid % 128 == 0:
            sm = cuda.shared.array(0, uint32, alignment=1024)
            i = (bar - operands.shared_address(sm) - uint32(bars_off)) // uint32(8)  # which barrier
            kind = uint32(0)  # full[s]
            if i >= uint32(2 * stages + consumers):
                kind = uint32(3)  # q_empty[c]
            elif i >= uint32(2 * stages):
                kind = uint32(2)  # q_full[c]
            elif i >= uint32(stages):
                kind = uint32(1)  # empty[s]
            record(tid // 128, kind, i | (parity << uint32(8)), t0, dt)

    @cuda.jit(device=True, inline=True)
    def bar_sync(barrier, count):
        """raw_bar_sync, timed (kind 4)."""
        t0 = clock()
        raw_bar_sync(barrier, count)
        dt = clock() - t0
        tid = cuda.threadIdx.x
        if tid % 128 == 0:
            record(tid // 128, uint32(4), barrier | uint32(0x10000), t0, dt)

    return wait, bar_sync, mark, save, smem_bytes + 4 * roles * TRACE_WORDS
