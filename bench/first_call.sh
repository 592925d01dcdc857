#!/usr/bin/env bash
# The first device call of a session on four GPUs (nvidia-h200-x4, ~8 minutes), one job per GPU:
#   GPU 0: bench/verify_device.sh (GPU tests, backward alone, FT-only vs peft at 512, LoRA
#          overhead), then bench/coserve_latency.py (issue 5: latency-model error, pause delay);
#   GPU 1: bench/trace_vs_hf.py --only coserve       (issue 3 item 4: azure2023_conv, 300 s)
#   GPU 2: bench/trace_vs_hf.py --only transformers  (the peer, same arrivals, at the same time)
#   GPU 3: bench/engine_speed.py, the full grid (issue 3), then its decode and LoRA sections
#          with COSERVE_LORA_ONE_LAUNCH=1 (one launch per LoRA linear at decode, unmeasured), then
#          bench/eager_cpu.py without and with --prefill-graphs (piecewise graphs, unmeasured).
# Everything comes back in one archive, $OUT/first.tar.gz (folder first/, GPU 0's files in first/verify/).
# Carry .traces.
#
#   export COSERVE_COMMIT=<sha> COSERVE_DIRTY=0; bench/first_call.sh
set -uo pipefail
: "${OUT:?OUT must name the output folder}"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-cuda-mps-control -d 2>/dev/null || true  # before any CUDA client, for every job
top=$OUT/first
mkdir -p "$top/verify"
(
  OUT=$top/verify CUDA_VISIBLE_DEVICES=0 bench/verify_device.sh > "$top/verify/verify.txt" 2>&1
  CUDA_VISIBLE_DEVICES=0 python3 bench/coserve_latency.py --trace .traces/azure2023_conv.csv --duration 60 \
    --trainer-sm-share 50 --no-reference --out "$top/verify/coserve_latency.json" > "$top/verify/coserve_latency.log" 2>&1
  echo "coserve_latency rc=$?" >> "$top/verify/verify.txt"
) &
for side in coserve:1 transformers:2; do
  CUDA_VISIBLE_DEVICES=${side#*:} python3 bench/trace_vs_hf.py --trace .traces/azure2023_conv.csv --duration 300 \
    --only "${side%%:*}" --out "$top/trace_vs_hf_${side%%:*}.json" > "$top/trace_vs_hf_${side%%:*}.log" 2>&1 &
done
(
  CUDA_VISIBLE_DEVICES=3 python3 bench/engine_speed.py --out "$top/engine_speed.json" > "$top/engine_speed.log" 2>&1
  # the one-launch LoRA kernel for decode-sized steps against engine_speed.json's two launches
  CUDA_VISIBLE_DEVICES=3 COSERVE_LORA_ONE_LAUNCH=1 python3 bench/engine_speed.py --sections decode,lora \
    --batches 1,16 --contexts 2048 --out "$top/engine_lora_one_launch.json" > "$top/engine_lora_one_launch.log" 2>&1
  # eager steps' host and device time without and with the piecewise prefill graphs
  for pg in off on; do
    flags=(--conditions idle); [[ $pg == on ]] && flags+=(--prefill-graphs)
    CUDA_VISIBLE_DEVICES=3 python3 bench/eager_cpu.py "${flags[@]}" --out "$top/eager_cpu_$pg.json" \
      > "$top/eager_cpu_$pg.log" 2>&1
  done
) &
wait
cat "$top/verify/verify.txt"
tail -n 4 "$top"/*.log
tar -czf "$OUT/first.tar.gz" -C "$OUT" first && rm -rf "$top"
