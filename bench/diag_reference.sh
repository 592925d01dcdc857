#!/usr/bin/env bash
# Why is the first replay after start-up slower (bench/results/diagnostic/README.md)? Two
# benchmarks side by side on azure2023_code, 30 s windows, no calibration in either:
#   GPU 0: inference, inference-last              (a second replay, nothing in between)
#   GPU 1: inference, temporal, inference-last    (a trainer process in between; the latency
#                                                  state comes from a file, so no calibration)
# DIAG_FLAGS are added to both (e.g. "--stream-priority high"). DIAG_GPU=N runs both on GPU N,
# one after the other; DIAG_RUNS=a (or b) runs that one alone. `b` loads the latency state of session 3's
# evaluation (same model and engine settings); the trace comes from .traces (carry it).
# Outputs packed into $OUT/$DIAG_NAME.tar.gz (default diag), so two can run side by side.
set -uo pipefail
: "${OUT:?OUT must name the output folder}"
export PYTHONPATH=src PYTHONUNBUFFERED=1
name=${DIAG_NAME:-diag}
nvidia-cuda-mps-control -d 2>/dev/null || true
common=(--model shape:llama3-8b --device cuda --max-model-len 8192 --max-num-batched-tokens 2048
  --max-loras 0 --gpu-memory-utilization 0.7 --lora-rank 16 --target-modules q_proj,k_proj,v_proj,o_proj
  --ft-lengths spread:256-1024 --duration 30 --drain 10 --rate-scale 0.13 --workload azure2023_code
  --no-plots ${DIAG_FLAGS:-})  # shellcheck disable=SC2206  # a list of flags
mkdir -p "$OUT/$name/a" "$OUT/$name/b"
run_a() {
  CUDA_VISIBLE_DEVICES=$1 python3 -m coserve.server.bench_cli "${common[@]}" --configs inference,inference-last \
    --out "$OUT/$name/a" > "$OUT/$name/a/log.txt" 2>&1
}
run_b() {
  CUDA_VISIBLE_DEVICES=$1 python3 -m coserve.server.bench_cli "${common[@]}" \
    --configs inference,temporal,inference-last --latency-state bench/results/eval_h200/azure2023_code/azure2023_code-latency-state.json \
    --out "$OUT/$name/b" > "$OUT/$name/b/log.txt" 2>&1
}
if [[ "${DIAG_RUNS:-ab}" != ab ]]; then  # DIAG_RUNS=a or b: that one alone, on DIAG_GPU (default 0)
  "run_$DIAG_RUNS" "${DIAG_GPU:-0}"
elif [[ -n "${DIAG_GPU:-}" ]]; then  # one GPU: a, then b
  run_a "$DIAG_GPU"; run_b "$DIAG_GPU"
else
  run_a 0 & run_b 1 & wait
fi
tail -n 12 "$OUT/$name"/*/log.txt
tar -czf "$OUT/$name.tar.gz" -C "$OUT" "$name" && rm -rf "${OUT:?}/$name"
