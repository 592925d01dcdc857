#!/usr/bin/env bash
# The first device call of a session after GPU code changed (about 7 minutes on one H200):
# the GPU kernels and the trainer's backwards against their references, the trainer's backward
# by task size (and with the worker's one-boundary lookahead), fine-tuning throughput with and
# without kept MLP activations beside the peft loops in the same run (512-token sequences), and
# the LoRA overhead with fused launches. Everything lands in $OUT (at most 8 files come back).
#
#   export COSERVE_COMMIT=<sha> COSERVE_DIRTY=0; bench/verify_device.sh
set -uo pipefail
: "${OUT:?OUT must name the output folder}"
export PYTHONPATH=src PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/layers tests/trainer/test_backward.py \
  tests/engine/test_cuda_graph.py tests/engine/test_prefill_graphs.py tests/engine/test_stream_priority.py > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?"; tail -n 3 "$OUT/gpu_tests.txt"
for run in 2 8 8:--boundary-sync; do
  rows=${run%%:*}; flag=${run#"$rows"}; flag=${flag#:}
  echo "== profile_ft: $rows rows x 512 $flag"
  # shellcheck disable=SC2086  # an empty flag is no argument
  python3 bench/profile_ft.py --rows "$rows" --row-len 512 --no-profile $flag \
    --out "$OUT/profile_ft_$rows${flag:+_sync}.json" 2>&1 | grep -E '"(tokens|forward_s|backward_s|backward_dispatch_s)"'
done
python3 bench/ft_throughput.py --lengths 512 --accumulation-tasks 1,2 \
  --save-mlp-activations both --out "$OUT/ft_throughput.json" > "$OUT/ft_throughput.log" 2>&1
echo "ft_throughput rc=$?"; grep seq_len "$OUT/ft_throughput.log" | head -n 1
python3 bench/engine_speed.py --sections decode,lora --batches 1,16 --contexts 2048 \
  --out "$OUT/engine_lora.json" > "$OUT/engine_lora.log" 2>&1
echo "engine_speed rc=$?"; tail -n 5 "$OUT/engine_lora.log"
