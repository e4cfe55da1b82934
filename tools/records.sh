#!/usr/bin/env bash
# The benchmark records of docs/bench/, made again on a GPU machine with torch:
#
#   tools/records.sh compile     every kernel into the kernel cache, one process per core
#   tools/records.sh reference   the ten reference shapes (D 64 and 128, fp16 and bf16, causal and
#                                not, grouped queries), every kernel and peer, with the tail and the call
#   tools/records.sh latency     what a call costs at small shapes (phase 09, and 10 at the decode
#                                steps) beside SDPA flash and cuDNN
#   tools/records.sh reference_calls   what a call costs at the four fp16 reference shapes: phase 09
#                                alone beside SDPA flash and cuDNN (the _p09 records), in a fraction of
#                                reference's time
#   tools/records.sh decode      issue 40's decode steps (phases 07, 09, 10 and SDPA, with the copy's
#                                bandwidth) and attention_kvcache's records (docs/bench/kvcache/)
#   tools/records.sh latency_decode   latency's two decode steps alone
#   tools/records.sh first_call  the first attention() call of new processes, the kernel cache warm and
#                                empty, at the latency table's first shape and the reference shape
#   tools/records.sh backward    the backward at the reference shape (D 64 and 128, causal and not)
#                                beside SDPA's flash and cuDNN backward and FlexAttention's, with the call
#   tools/records.sh flex        phase 14 (flex_attention) beside torch's FlexAttention, the same mods,
#                                at issue 77's shapes (B16 H16 S4096, D 64 and 128, forward and backward;
#                                a window at S 32768, forward)
#
# then `flashcore report`. FC names the command (default `python3 -m flashcore_numba`). On a machine
# that received the working tree without its history (or with an older copy of .git, whose HEAD is
# not the tree's), pass the commit the tree holds, as the machine that sent it names it:
# FLASHCORE_GIT_COMMIT=<that commit> FLASHCORE_GIT_DIRTY=0 (the records' provenance).
set -euo pipefail
cd "$(dirname "$0")/.."
FC=${FC:-"python3 -m flashcore_numba"}
run() { echo "+ $*"; $FC "$@"; }
TAIL=(--tail 1000 --calls 1000 --cap-seconds 1)

compile() { run compile; }

reference() {
  for dtype in ${DTYPES:-fp16 bf16}; do
    for D in 64 128; do
      for causal in "" --causal; do
        run bench --dtype "$dtype" --shape "16,16,2048,$D" $causal "${TAIL[@]}"
      done
    done
  done
}

reference_calls() {
  for D in 64 128; do
    for causal in "" --causal; do
      run bench --shape "16,16,2048,$D" $causal --phases 09 --peers flash,cudnn "${TAIL[@]}"
    done
  done
}

gqa() {
  for causal in "" --causal; do
    run bench --shape 16,32,2048,64 --kv-heads 8 $causal "${TAIL[@]}"
  done
}

latency() {
  for shape in 1,16,128,64 1,16,512,64 4,16,1024,128; do
    run bench --shape "$shape" --phases 09 --peers flash,cudnn "${TAIL[@]}"
  done
  latency_decode
}

decode() {
  # issue 40's decode steps: one long cache and a shorter one (32 query heads on 8 K/V heads),
  # phases 07, 09 and 10 beside SDPA with the copy's bandwidth; then attention_kvcache: the long
  # cache contiguous and paged, 64 ragged caches, and 8 caches of 2048 keys without grouping
  for S_k in 32768 8192; do
    run bench --shape 1,32,1,128 --seq-k "$S_k" --kv-heads 8 --phases 07,09,10 --peers flash,cudnn "${TAIL[@]}"
  done
  run bench --kvcache 1,32768,32768 --shape 1,32,1,128 --kv-heads 8 --page-sizes 64,256
  run bench --kvcache 64,1,8192 --shape 1,32,1,128 --kv-heads 8
  run bench --kvcache 8,2048,2048 --shape 1,32,1,128
}

latency_decode() {
  # latency's decode steps, phases 09 and 10 side by side: attention() runs 10 (split keys) at the
  # first, whose 16 K/V heads leave most SMs idle, and 09 at the second (256 K/V heads:
  # api.best_for_shape)
  run bench --shape 1,16,1,128 --seq-k 4096 --phases 09,10 --peers flash,cudnn "${TAIL[@]}"
  run bench --shape 8,32,1,128 --seq-k 2048 --phases 09,10 --peers flash,cudnn "${TAIL[@]}"
}

first_call() {
  # a new process's first call: 3 processes a problem with the cache warm, 3 with it empty (each compiles)
  run bench --first-call --cold --shape 1,16,128,64
  run bench --first-call --cold --shape 16,16,2048,128 --causal
}

backward() {
  for D in 64 128; do
    for causal in "" --causal; do
      run bench --backward --shape "16,16,2048,$D" $causal --peers flash,cudnn,flex --calls 1000 --cap-seconds 1
    done
  done
}

flex() {
  for D in 64 128; do
    run bench --flex --backward --shape "16,16,4096,$D" --calls 1000 --cap-seconds 1
  done
  # issue 77's long window: S = 32768, a window of 1024 beside attention(causal=True)
  run bench --flex --shape 1,16,32768,64 --cases sliding_window,causal_mask --calls 1000 --cap-seconds 1
}

for step in "$@"; do "$step"; done
