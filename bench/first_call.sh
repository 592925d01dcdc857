#!/usr/bin/env bash
# The first device call of a session on two GPUs (nvidia-h200-x2, ~8 minutes): the verification
# (bench/verify_device.sh: GPU tests, backward alone, FT-only throughput, LoRA overhead) on GPU 0,
# beside the first-replay diagnosis (bench/diag_reference.sh, both benchmarks one after the other)
# on GPU 1. Flags for the diagnosis come from $DIAG_FLAGS. Everything comes back in two archives:
# $OUT/verify.tar.gz and $OUT/diag.tar.gz. Carry .traces.
#
#   export COSERVE_COMMIT=<sha> COSERVE_DIRTY=0; bench/first_call.sh
set -uo pipefail
: "${OUT:?OUT must name the output folder}"
nvidia-cuda-mps-control -d 2>/dev/null || true  # before any CUDA client, for both jobs
top=$OUT
mkdir -p "$top/verify"
(OUT=$top/verify CUDA_VISIBLE_DEVICES=0 bench/verify_device.sh > "$top/verify/verify.txt" 2>&1) &
DIAG_GPU=1 bench/diag_reference.sh
wait
cat "$top/verify/verify.txt"
tar -czf "$top/verify.tar.gz" -C "$top" verify && rm -rf "$top/verify"
