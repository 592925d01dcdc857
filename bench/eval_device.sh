#!/usr/bin/env bash
# Issue 6 on the device machine: one `coserve bench` per workload, all configurations on the same
# arrivals, the workloads spread over the visible GPUs (one per GPU at a time), every output
# packed into $OUT/eval.tar.gz (the device tool brings back at most 8 files).
#
#   bench/eval_device.sh WORKLOAD=RATE[=EXTRA_CONFIGS] ...
#
# RATE is a fixed --rate-scale, or "auto:START" for --auto-rate from START. EXTRA_CONFIGS are
# added after inference,full and before split,naive,temporal (e.g. "full-noint" for burst-light). Flags common
# to every run come from $BENCH_FLAGS (appended last, so they override the defaults below), the
# per-workload time budget from $BUDGET (seconds, default 540), the GPUs to use from $GPUS
# (indices separated by spaces, default all), configurations to run after all others from $LAST
# (e.g. "inference-last": the reference again, to show whether the order biased it), or the whole
# list from $CONFIGS. Example (one H200, one workload):
#
#   export COSERVE_COMMIT=<sha> COSERVE_DIRTY=0; bench/eval_device.sh burst-light=0.3=full-noint
set -uo pipefail
: "${OUT:?OUT must name the output folder}"
export PYTHONPATH=src PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-540}
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
(( ngpu > 0 )) || { echo "no GPU visible" >&2; exit 1; }
read -r -a gpus <<< "${GPUS:-$(seq -s ' ' 0 $(( ngpu - 1 )))}"
ngpu=${#gpus[@]}
# One MPS control daemon for every GPU, started before any CUDA client.
nvidia-cuda-mps-control -d 2>/dev/null || true
# An archive from an earlier run into the same $OUT (two eval= jobs in one first_call.sh lane):
# unpacked first, so that the archive written below holds both runs' workloads.
if [[ -f $OUT/eval.tar.gz ]]; then
  tar -xzf "$OUT/eval.tar.gz" -C "$OUT" && rm "$OUT/eval.tar.gz"
fi
mkdir -p "$OUT/eval"
running=0
for spec in "$@"; do
  IFS='=' read -r workload rate extra <<< "$spec"
  # the reference first, then in order of importance should the time budget run out ($CONFIGS:
  # the whole list instead, e.g. "inference,full,full-graphs,split-20,naive,temporal")
  configs=${CONFIGS:-inference,full${extra:+,$extra},split,naive,temporal${LAST:+,$LAST}}
  case $rate in
    auto:*) rate_flags=(--auto-rate --rate-scale "${rate#auto:}") ;;
    *) rate_flags=(--rate-scale "$rate") ;;
  esac
  dir=$OUT/eval/$workload
  mkdir -p "$dir"
  gpu=${gpus[$(( running % ngpu ))]}
  echo "== $workload on GPU $gpu: ${rate_flags[*]} configs $configs"
  # shellcheck disable=SC2086  # BENCH_FLAGS is a list of flags
  CUDA_VISIBLE_DEVICES=$gpu python3 -m coserve.server.bench_cli \
    --model shape:llama3-8b --device cuda --max-model-len 8192 --max-num-batched-tokens 2048 \
    --max-loras 0 --gpu-memory-utilization 0.7 --lora-rank 16 \
    --target-modules q_proj,k_proj,v_proj,o_proj --ft-lengths spread:256-1024 \
    --duration 60 --time-budget "$BUDGET" "${rate_flags[@]}" \
    --workload "$workload" --configs "$configs" --out "$dir" ${BENCH_FLAGS:-} \
    > "$dir/log.txt" 2>&1 &
  running=$(( running + 1 ))
  if (( running % ngpu == 0 )); then wait; fi
done
wait
tail -n 12 "$OUT"/eval/*/log.txt
tar -czf "$OUT/eval.tar.gz" -C "$OUT" eval && rm -rf "$OUT/eval"
