"""Writes p10v8.py beside this file: make_variant7.py's p10v7 (the padding rows' softmax left out
at decode) with a look at the first team's counter before the block's own merge.

On the GPU's clock the root merge ends 2.7 µs after the last member arrives, and before it the
last block pays for a fence (its partial's stores acknowledged) and an atomic (a round trip to
L2) just to learn that it is last. Here thread 0 reads the team's counter (an atomic add of 0)
as soon as the block's warps are done, before the block merges its warps' partials: if every
other member had already counted, this block is the last one and no other block will count, so
it skips the fence and the atomic and merges the team at once (thread 0 fences after the read,
an acquire, and a barrier hands that on to the block's threads; the block's own partial was
written by its own threads before a barrier). Otherwise it counts as before. The read is waited
for by thread 0 only, while the block's other warps work on their rows' weights."""
from make_variant7 import HALF, HEADER, here, src, write

PEEK = [
    ("""    def arrive(COUNTERS, counter, members, tid, done_s):
""", """    def arrive(COUNTERS, counter, members, tid, done_s, peek):
"""),
    ("""        done_s: one int32 of shared memory, through which the block's threads learn the count.\"\"\"
        cuda.threadfence()  # every thread's partials, before the block counts
""", """        done_s: one int32 of shared memory, through which the block's threads learn the count.
        peek: thread 0's earlier read of the counter (-1 if none).\"\"\"
        if tid == 0:
            done_s[0] = peek
        cuda.syncthreads()
        if done_s[0] == members - 1:  # every other member had counted when thread 0 looked
            if tid == 0:
                COUNTERS[counter] = 0
            return True
        cuda.threadfence()  # every thread's partials, before the block counts
"""),
    ("""        last_level = cuda.gridDim.x == 1  # one block: its merge is the output
        cuda.syncthreads()  # every warp's partial is written
""", """        last_level = cuda.gridDim.x == 1  # one block: its merge is the output
        cuda.syncthreads()  # every warp's partial is written
        peek = int32(-1)
        if tid == 0 and not last_level:
            team0 = slot // FAN_IN
            counter0 = ((b * H_kv + h_kv) * row_tiles + tile) * div32(
                COUNTERS.shape[0], cuda.gridDim.y * cuda.gridDim.z) + team0
            peek = cuda.atomic.add(COUNTERS, counter0, 0)
            if peek == min(FAN_IN, cuda.gridDim.x - team0 * FAN_IN) - 1:
                cuda.threadfence()  # acquire: the members' partials, read after their count
"""),
    ("""            if not arrive(COUNTERS, counters + team, members, tid, done_s):
""", """            if not arrive(COUNTERS, counters + team, members, tid, done_s, peek):
"""),
    ("""            counters += teams  # past this level's counters
""", """            counters += teams  # past this level's counters
            peek = int32(-1)
"""),
]

if __name__ == "__main__":
    write("p10v8", HEADER + HALF + PEEK)
