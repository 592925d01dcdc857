#!/usr/bin/env bash
# Is the host CPU what slows eager steps and the co-serving trainer? One H200, everything in turn
# (nothing beside it on the machine), about 7 minutes:
#   1. bench/diag_reference.sh run `b` alone (inference, temporal, inference-last on azure2023_code,
#      30 s) with a profiler window, and the steps' forward CPU time (forward_cpu_s);
#   2. bench/eager_cpu.py: eager steps' enqueue vs device time, machine idle vs CPU hogs;
#   3. bench/profile_ft.py: one 4,096-token backward alone, then beside CPU hogs (its CPU time);
#   4. bench/ft_throughput.py at 256 and 1,024 tokens beside the peft loops (issue 4).
# Outputs under $OUT (diag.tar.gz and the JSON files).
#
#   export COSERVE_COMMIT=<sha> COSERVE_DIRTY=0; bench/diag_cpu.sh
set -uo pipefail
: "${OUT:?OUT must name the output folder}"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-cuda-mps-control -d 2>/dev/null || true
echo "cores: $(nproc)"
DIAG_RUNS=b DIAG_FLAGS="--profile-window 5:15" bench/diag_reference.sh
python3 bench/eager_cpu.py --out "$OUT/eager_cpu.json" > "$OUT/eager_cpu.log" 2>&1
echo "eager_cpu rc=$?"; grep -E " (idle|hog|hog_one_thread|idle_one_thread) " "$OUT/eager_cpu.log" | cut -c1-600
hog() { python3 -c 'import multiprocessing as m, os
def spin():
    while True: sum(range(10000))
ps=[m.Process(target=spin, daemon=True) for _ in range(os.cpu_count())]
[p.start() for p in ps]; [p.join() for p in ps]' & }
for cond in idle hog; do
  if [[ $cond == hog ]]; then hog; pid=$!; sleep 1; fi
  echo "== profile_ft 8 x 512, $cond"
  python3 bench/profile_ft.py --rows 8 --row-len 512 --no-profile --out "$OUT/profile_ft_$cond.json" 2>&1 \
    | grep -E '"(forward_s|backward_s|backward_dispatch_s|backward_cpu_s)"'
  if [[ $cond == hog ]]; then kill -- "$pid"; pkill -f 'sum\(range' ; fi
done
python3 bench/ft_throughput.py --lengths 256,1024 --out "$OUT/ft_throughput_256_1024.json" \
  > "$OUT/ft_throughput_256_1024.log" 2>&1
echo "ft_throughput rc=$?"; grep -E '"coserve_over_peft_gc"|seq_len' "$OUT/ft_throughput_256_1024.log" | cut -c1-400
