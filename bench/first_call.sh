#!/usr/bin/env bash
# The first device calls of a session: named jobs, spread over the GPUs in lanes, one lane per
# GPU (its jobs run one after the other), every job cut off at a common deadline so that the
# archive is always written. Everything comes back in one archive, $OUT/first.tar.gz (folder
# first/, laid out as bench/first_call_report.py reads it). Carry .traces.
#
#   export COSERVE_COMMIT=<sha> COSERVE_DIRTY=0; bench/first_call.sh "LANE0 JOBS" "LANE1 JOBS" ...
#
# Jobs:
#   gpu_tests      the GPU tests (kernels against their CPU references, backward, graphs)
#   gate_tests     the trainer's GPU-side pause gate and process tests alone
#   loss_ce        the fused cross-entropy kernel's tests (tests/trainer/test_triton_loss.py), then
#                  bench/loss_ce.py: a loss chunk's stretches by the torch chain and fused (loss_ce.json)
#   kernel_tests   the attention kernel tests alone (tests/layers/test_triton_kernels.py, varlen)
#   varlen_tests   the trainer's varlen recompute attention, SDPA's backends, the backward (GPU)
#   verify         bench/verify_device.sh (GPU tests, backward alone, FT-only vs peft, LoRA overhead)
#   ft512          FT-only vs the peft loops at 512-token sequences (issue 4)
#   ftab           FT-only at 512, coserve alone, by trainer variant: default, no GPU-side pause gate
#                  (COSERVE_GPU_GATE=0), untrained-MLP pieces of 512 and of 4,096 tokens; or the
#                  variants in $FT_VARIANTS ("NAME:VAR=VALUE ...", e.g. "default: loss256:COSERVE_LOSS_CHUNK=256")
#   lora           decode and LoRA overhead at context 2048 (issue 3)
#   lora_nofork    the same with COSERVE_LORA_FORK=0 (no LoRA shrink on a side stream in the graphs)
#   lora_split=N   the same with COSERVE_LORA_SPLIT_WAVES=N (prefill LoRA shrinks split-K to N waves)
#   lora_tile=N    the same with COSERVE_LORA_SHRINK_TILE=N (rows per prefill shrink program; 64 default)
#   lora_pinned    the lora job with COSERVE_PINNED_INPUTS=1 (step inputs through pinned memory, no wait)
#   lora_mid       the LoRA overhead at 512/1,024/2,048-token prefills (co-serving's mixed-step sizes,
#                  where the shrink splits K)
#   lora_mid_graphs  lora_mid through the piecewise prefill graphs (--prefill-graphs: the mid-size
#                  steps replay their LoRA kernels instead of launching them from Python)
#   lora_waves=N   the lora job with COSERVE_LORA_EXPAND_WAVES=N (0: one column block per expand program)
#   lora_kernels   bench/lora_kernels.py: the LoRA kernels alone at the 8B linears, by launch setting,
#                  beside .baseline/triton_lora.py when it is there (carry .baseline)
#   lora_expand_first  the same with COSERVE_LORA_EXPAND_FIRST=1 (large eager steps: LoRA delta
#                  stored first, the base GEMM accumulating onto it)
#   lora_profile   bench/profile_lora.py (a 4,096-token prefill's GPU time by kernel, without and
#                  with 4 adapters), with COSERVE_LORA_EXPAND_FIRST off, then on
#   grid           the full bench/engine_speed.py grid (issue 3)
#   trace_coserve  bench/trace_vs_hf.py, coserve's side (issue 3 item 4)
#   trace_peer     bench/trace_vs_hf.py, the transformers peer's side (same arrivals)
#   latency        bench/coserve_latency.py (issue 5: latency-model error, pause delay), the trainer
#                  at a 50% MPS share; latency=N: at N% (latency=100: no share)
#   latency_eager  the latency job with --no-prefill-graphs (steps with prefill or FT rows eager, as
#                  before session 12 made the piecewise CUDA graphs the default)
#   latency_varlen the latency job with COSERVE_VARLEN_PREFILL=1 (each run of rows without cached
#                  context in one varlen flash call); latency_threads1: with one intra-op thread
#                  in the engine (--threads 1)
#   lora_mid_varlen  lora_mid with COSERVE_VARLEN_PREFILL=1
#   latency_nopieces the latency job with COSERVE_TRAINER_ATTN_PIECES=0 (the trainer's attention half
#                  in one piece, as before session 12 made the three pieces the default)
#   lora_mid_graphs_ef  lora_mid_graphs with COSERVE_LORA_GRAPH_EXPAND_FIRST=1 (the graphs of more than
#                  256 tokens store the LoRA delta first, as large eager steps do)
#   trainer_attn   bench/profile_trainer_cpu.py on CUDA, the 8B shape, by COSERVE_VARLEN_ATTN
#                  (torch, flash_fn, flash): the attention recompute's and backward's host and GPU ms
#   trainer_stretches  bench/profile_trainer_cpu.py on CUDA, the 8B shape at a 50% MPS share: each of a
#                  layer's stretches (layer#k as in the latency run's trainer_spans), host ms in wall
#                  and in process CPU time, GPU ms, aten ops; bench/gate_cost.py (a boundary's calls)
#   trainer_by_hand  trainer_stretches' profile (50% MPS share, wall and process clocks) with
#                  COSERVE_TRAINER_ATTN_BY_HAND=0 and =1, alternating, two runs each (eight profile runs,
#                  ~14 s each in session 21)
#   split_check    bench/split_step_check.py at the 8B shape (4 layers, 9 rows) at a 20% MPS share with
#                  COSERVE_LORA_FP32_MM auto and 0, and on the whole GPU; bench/skinny_mm_check.py at 20%
#                  (the split baseline's NaN, sessions 10-11)
#   mps_ops        bench/mps_op_check.py (the split step's ops against fp32) on the whole GPU, at a 20%
#                  share, and on the whole GPU with --poison
#   latency_warm   latency=50 with --warm-replays 1: after the trainer-idle replay, the trace window
#                  once more with fine-tuning on, predicted by the model the runs before refitted
#                  (latency_model_error_warm: a restarted server's --latency-state, or one serving a while)
#   latency_hold   latency=50 with --hold-pause (SLOConfig.hold_pause)
#   latency_early=MS  latency=50 with --early-pause-ms MS (the backward paused MS before a decode step's
#                  predicted end when a request arrived during it; the pause delay runs from the step's start)
#   latency_early_hold=MS  latency_early=MS with --hold-pause (SLOConfig.hold_pause: no resume between the
#                  steps of a burst)
#   latency_prio   latency=50 with --stream-priority high (the engine's stream at the highest priority,
#                  the trainer a below-normal MPS client)
#   latency_profile  latency=50 with --profile-layer0 (cProfile of each FT-only step's layer 0 on the host)
#   latency_env=VAR=VALUE[,VAR=VALUE...]  latency=50 with these in the environment, e.g. COSERVE_LOSS_CHUNK=256
#                  or COSERVE_TRAINER_RELEASE=1,COSERVE_TRAINER_RELEASE_TIMEOUT_MS=5
#                  (the loss in 256-target chunks) or COSERVE_MLP_CHUNK=1024 (untrained-MLP pieces)
#   latency_eager_env=VAR=VALUE[,VAR=VALUE...]  latency_eager with these in the environment, e.g.
#                  COSERVE_TRAINER_CLOSED_AHEAD=2 (the trainer's CPU asleep behind a closed gate)
#   decode_longest bench/decode_longest.py: decode graph steps at the same rows and total KV, one KV
#                  length for all rows against spread lengths and one long row (the decode terms)
#   prefill_context  bench/prefill_context.py: the paged prefill kernel with its cached prefix in splits
#                  and without (COSERVE_PREFILL_SPLITS), a short chunk over a long prefix, one layer
#   prefill_fresh  bench/prefill_context.py with a fresh chunk of 400 or 1,024 tokens beside the short
#                  chunk over a long prefix: splits sized by the context tiles (COSERVE_PREFILL_SPLIT_TILES
#                  context) against every tile (all, the rule before session 35) and no split
#   prefix_cache   bench/prefix_cache.py on the 8B shape, with the prefix cache and without
#   jobs_replay    bench/jobs_during_replay.py: a fine-tuning job through the API (upload, create, pause,
#                  resume, cancel) while coserve serve answers a replay (carry .whl: bench/server_wheels.sh);
#                  jobs_replay_switch=MS: the same with the server's --switch-interval-ms MS (its default 0.1;
#                  CPython's 5), as jobs_replay_switchMS.{json,log}; jobs_resume: a shorter one (50 s, the
#                  job at 5 s, the pause at 28, the resume at 31; ~190 s) for the resume's set-up alone
#   eager          bench/eager_cpu.py without and with --prefill-graphs
#   eager_spread   bench/eager_cpu.py: three eager steps' host time, 200 times each, idle and beside
#                  spinning processes, with its spread (p10/p90/p99) and the thread's CPU time
#   spare_start    bench/spare_start.py: a trainer's start spawned afresh against one from a spare interpreter
#                  at the 8B shape (stages, seconds, the adapters compared; ~60 s)
#   state_copy     bench/state_copy_cost.py: a copy of the trainer's state at the 8B shape (a checkpoint's,
#                  a pause's) by way of copying, and a pause's copying work before and after session 44
#   eager_small    bench/eager_cpu.py --prefill-graphs on small steps (a short chunk beside 32 decodes), with
#                  the operator and the Python profiles of one step each
#   eval=SPEC      bench/eval_device.sh SPEC on this lane's GPU (SPEC as there: WORKLOAD=RATE[=EXTRA],
#                  with $BUDGET and $BENCH_FLAGS), its archive kept as first/eval.tar.gz
#   trainer_first_tasks  bench/trainer_first_tasks.py: the trainer's first tasks' host stretches by warm-up
#   NAME#K         any job NAME once more, its files under first/rK/ (e.g. "latency=50 latency=50#2")
# With no lanes given, the four-GPU layout of session 4:
#   "verify latency" "trace_coserve" "trace_peer" "grid eager"
# Environment: DEADLINE (seconds from start, default 565), TRACE_RATE (trace replay rate
# scale, default 3), TRACE_SECONDS (default 300), TRACE_DRAIN (default 60), H100_LANES (the lanes,
# '|' between two, to run instead on a GPU that is no H200: H100_LANES="latency latency#2").
set -uo pipefail
: "${OUT:?OUT must name the output folder}"
export PYTHONPATH=src PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then  # the server's packages, carried (bench/server_wheels.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
DEADLINE=${DEADLINE:-565}
TRACE_RATE=${TRACE_RATE:-3}
TRACE_SECONDS=${TRACE_SECONDS:-300}
TRACE_DRAIN=${TRACE_DRAIN:-60}
began=$SECONDS
nvidia-cuda-mps-control -d 2>/dev/null || true  # before any CUDA client, for every job
top=$OUT/first
mkdir -p "$top/verify"

# run NAME LOG CMD...: the command with what is left of the deadline, its exit status logged
run() {
  local name=$1 log=$2; shift 2
  local left=$(( DEADLINE - (SECONDS - began) ))
  if (( left < 20 )); then echo "$name: skipped, deadline" | tee -a "$top/status.txt"; return; fi
  timeout -k 5 "$left" "$@" > "$log" 2>&1
  echo "$name rc=$? after $(( SECONDS - began )) s" | tee -a "$top/status.txt"
}

trace() {  # trace SIDE
  run "trace_$1" "$top/trace_vs_hf_$1.log" python3 bench/trace_vs_hf.py --trace .traces/azure2023_conv.csv \
    --duration "$TRACE_SECONDS" --rate-scale "$TRACE_RATE" --drain "$TRACE_DRAIN" --only "$1" \
    --out "$top/trace_vs_hf_$1.json"
}

lora_bench() {  # lora_bench NAME PATH_STEM [FLAGS...]: decode and LoRA overhead at context 2048
  local name=$1 stem=$2; shift 2
  run "$name" "$stem.log" python3 bench/engine_speed.py --sections decode,lora --batches 1,16,64 --contexts 2048 \
    "$@" --out "$stem.json"
}

latency_bench() {  # latency_bench NAME PATH_STEM [FLAGS...] (with $LATENCY_ENV, VAR=VALUE[,VAR=VALUE...], set for it)
  local name=$1 stem=$2; shift 2
  local -a settings=()
  [ -n "${LATENCY_ENV:-}" ] && IFS=, read -r -a settings <<< "$LATENCY_ENV"
  run "$name" "$stem.log" env "${settings[@]}" python3 bench/coserve_latency.py --trace .traces/azure2023_conv.csv --duration 60 \
    "$@" --no-reference --out "$stem.json"
}

job() {
  if [[ $1 == *'#'* ]]; then  # NAME#K: job NAME once more, its files under first/rK/ (the pause p99 moves between runs)
    local top="$top/r${1##*#}"
    mkdir -p "$top/verify"
    job "${1%#*}"
    return
  fi
  case $1 in
    gpu_tests)
      run gpu_tests "$top/verify/gpu_tests.txt" python3 -m pytest -q -p no:cacheprovider -p no:warnings \
        tests/layers tests/trainer/test_backward.py tests/trainer/test_triton_loss.py tests/trainer/test_stream_gate.py \
        tests/engine/test_cuda_graph.py \
        tests/engine/test_prefill_graphs.py tests/engine/test_stream_priority.py tests/engine/test_host_copy.py \
        tests/engine/test_step_clock.py tests/engine/test_prefix_caching.py \
        "tests/trainer/test_attention_by_hand.py::test_the_hand_path_on_the_device" \
        "tests/engine/test_coserve_steps.py::test_a_name_bound_to_the_training_slot_serves_what_is_written_there"
      grep "^gpu_tests rc=" "$top/status.txt" | tail -n 1 | sed 's/gpu_tests/gpu tests/' >> "$top/verify/verify.txt" ;;
    loss_ce)  # the fused cross-entropy kernel against fp64 and the torch chain, then its stretch timed
      run loss_ce_tests "$top/verify/loss_ce_tests.txt" python3 -m pytest -q -p no:cacheprovider -p no:warnings \
        tests/trainer/test_triton_loss.py
      run loss_ce "$top/loss_ce.log" python3 bench/loss_ce.py --out "$top/loss_ce.json" ;;
    kernel_tests)
      run kernel_tests "$top/verify/kernel_tests.txt" python3 -m pytest -q -p no:cacheprovider -p no:warnings \
        tests/layers/test_triton_kernels.py tests/layers/test_varlen_attention.py ;;
    varlen_tests)
      run varlen_tests "$top/verify/varlen_tests.txt" python3 -m pytest -q -p no:cacheprovider -p no:warnings \
        tests/layers/test_varlen_attention.py tests/layers/test_sdpa.py tests/trainer/test_backward.py ;;
    gate_tests)
      run gate_tests "$top/verify/gate_tests.txt" python3 -m pytest -q -p no:cacheprovider -p no:warnings \
        tests/trainer/test_stream_gate.py tests/trainer/test_process.py ;;
    verify) OUT=$top/verify run verify "$top/verify/verify.txt" bench/verify_device.sh ;;
    ft512)
      run ft512 "$top/verify/ft_throughput.log" python3 bench/ft_throughput.py --lengths 512 \
        --out "$top/verify/ft_throughput.json" ;;
    ftab)  # FT-only at 512, coserve alone, by trainer variant (ft_<variant>.json)
      read -r -a variants <<< "${FT_VARIANTS:-default: nogate:COSERVE_GPU_GATE=0 mlp512:COSERVE_MLP_CHUNK=512 mlp4096:COSERVE_MLP_CHUNK=4096}"
      for v in "${variants[@]}"; do
        name=ft_${v%%:*}
        # shellcheck disable=SC2086  # the variant's assignments, none for the default
        run "$name" "$top/$name.log" env ${v#*:} python3 bench/ft_throughput.py --lengths 512 --skip-peft \
          --out "$top/$name.json"
      done ;;
    lora) lora_bench lora "$top/verify/engine_lora" ;;
    lora_split=*)  # COSERVE_LORA_SPLIT_WAVES=N: split-K LoRA shrinks in large steps too
      COSERVE_LORA_SPLIT_WAVES=${1#lora_split=} lora_bench "$1" "$top/engine_lora_split${1#lora_split=}" ;;
    lora_nofork) COSERVE_LORA_FORK=0 lora_bench lora_nofork "$top/engine_lora_nofork" ;;
    lora_mid) lora_bench lora_mid "$top/engine_lora_mid" --lora-prefill 512,1024,2048 ;;
    lora_mid_graphs) lora_bench lora_mid_graphs "$top/engine_lora_mid_graphs" --lora-prefill 512,1024,2048 \
      --prefill-graphs ;;
    lora_pinned) COSERVE_PINNED_INPUTS=1 lora_bench lora_pinned "$top/engine_lora_pinned" ;;
    lora_waves=*)  # COSERVE_LORA_EXPAND_WAVES=N: expand programs per SM aimed for
      COSERVE_LORA_EXPAND_WAVES=${1#lora_waves=} lora_bench "$1" "$top/engine_lora_waves${1#lora_waves=}" ;;
    lora_kernels)
      baseline=(); [[ -f .baseline/triton_lora.py ]] && baseline=(--baseline .baseline/triton_lora.py)
      run lora_kernels "$top/lora_kernels.log" python3 bench/lora_kernels.py "${baseline[@]}" \
        --out "$top/lora_kernels.json" ;;
    lora_tile=*)  # COSERVE_LORA_SHRINK_TILE=N: the prefill shrink's rows per program
      COSERVE_LORA_SHRINK_TILE=${1#lora_tile=} lora_bench "$1" "$top/engine_lora_tile${1#lora_tile=}" ;;
    lora_expand_first) COSERVE_LORA_EXPAND_FIRST=1 lora_bench lora_expand_first "$top/engine_lora_expand_first" ;;
    lora_profile)
      run lora_profile_off "$top/profile_lora_off.log" env COSERVE_LORA_EXPAND_FIRST=0 python3 bench/profile_lora.py \
        --out "$top/profile_lora_off.json"
      run lora_profile_on "$top/profile_lora_on.log" env COSERVE_LORA_EXPAND_FIRST=1 python3 bench/profile_lora.py \
        --out "$top/profile_lora_on.json" ;;
    grid) run grid "$top/engine_speed.log" python3 bench/engine_speed.py --out "$top/engine_speed.json" ;;
    trace_coserve) trace coserve ;;
    trace_peer) trace transformers ;;
    latency) latency_bench latency "$top/verify/coserve_latency" --trainer-sm-share 50 ;;
    latency_eager) latency_bench latency_eager "$top/coserve_latency_eager" --trainer-sm-share 50 --no-prefill-graphs ;;
    latency_varlen) COSERVE_VARLEN_PREFILL=1 latency_bench latency_varlen "$top/coserve_latency_varlen" \
      --trainer-sm-share 50 ;;
    latency_nopieces) COSERVE_TRAINER_ATTN_PIECES=0 latency_bench latency_nopieces "$top/coserve_latency_nopieces" \
      --trainer-sm-share 50 ;;
    latency_env=*)
      # latency=50 with environment variables set: latency_env=COSERVE_LOSS_CHUNK=256 (commas between several)
      local setting=${1#latency_env=}
      LATENCY_ENV=$setting latency_bench "$1" "$top/coserve_latency_env_${setting//[^A-Za-z0-9_]/_}" \
        --trainer-sm-share 50 ;;
    latency_eager_env=*)
      local eager_setting=${1#latency_eager_env=}
      LATENCY_ENV=$eager_setting latency_bench "$1" "$top/coserve_latency_eager_env_${eager_setting//[^A-Za-z0-9_]/_}" \
        --trainer-sm-share 50 --no-prefill-graphs ;;
    latency_threads1) latency_bench latency_threads1 "$top/coserve_latency_threads1" --trainer-sm-share 50 --threads 1 ;;
    lora_mid_graphs_ef) COSERVE_LORA_GRAPH_EXPAND_FIRST=1 lora_bench lora_mid_graphs_ef "$top/engine_lora_mid_graphs_ef" \
      --lora-prefill 512,1024,2048 --prefill-graphs ;;
    lora_mid_varlen) COSERVE_VARLEN_PREFILL=1 lora_bench lora_mid_varlen "$top/engine_lora_mid_varlen" \
      --lora-prefill 512,1024,2048 ;;
    trainer_attn)
      for impl in torch flash_fn flash; do
        run "trainer_attn_$impl" "$top/trainer_attn_$impl.log" env COSERVE_VARLEN_ATTN=$impl python3 \
          bench/profile_trainer_cpu.py --device cuda --shape llama3-8b --dtype bfloat16 --rank 16 --rows 5 \
          --min-len 120 --max-len 290 --reps 20 --ops --json "$top/trainer_attn_$impl.json"
      done ;;
    trainer_stretches)
      # the trainer's stretches at the 8B shape as the latency run's trainer runs them (a 50% MPS
      # share, ~1,300-token tasks): host ms in wall time (as the spans count it) and in the CPU time
      # of the process's threads (the difference: the host waiting, not working), GPU ms, aten ops
      # (the wall-time run also profiles one task: each stretch's ops by self host time, and the trace)
      for clock in wall process; do
        trace=(); [[ $clock == wall ]] && trace=(--trace --chrome-trace "$top/trainer_stretches_trace.json")
        run "trainer_stretches_$clock" "$top/trainer_stretches_$clock.log" env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 \
          python3 bench/profile_trainer_cpu.py --device cuda --shape llama3-8b --dtype bfloat16 --rank 16 --rows 5 \
          --min-len 200 --max-len 320 --reps 20 --ops --clock $clock "${trace[@]}" --json "$top/trainer_stretches_$clock.json"
      done
      [[ -f $top/trainer_stretches_trace.json ]] && gzip -f "$top/trainer_stretches_trace.json"
      # and the boundary's own calls, timed one by one (events, the gate's wait and mark, a poll)
      run trainer_gate_cost "$top/trainer_gate_cost.log" env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 \
        python3 bench/gate_cost.py --out "$top/trainer_gate_cost.json" ;;
    trainer_by_hand)
      # the attention half by hand against autograd's pieces (session 24): the same stretches, both
      # ways, alternating; the gradient hash in each log must be the same both ways
      for i in 1 2; do for sw in 0 1; do for clock in wall process; do
        run "trainer_by_hand${sw}_${clock}_$i" "$top/trainer_by_hand${sw}_${clock}_$i.log" \
          env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 COSERVE_TRAINER_ATTN_BY_HAND=$sw \
          python3 bench/profile_trainer_cpu.py --device cuda --shape llama3-8b --dtype bfloat16 --rank 16 --rows 5 \
          --min-len 200 --max-len 320 --reps 20 --ops --clock $clock --json "$top/trainer_by_hand${sw}_${clock}_$i.json"
      done; done; done ;;
    split_check)
      # the split baseline's step at the 8B shape (4 layers, 9 rows: session 11's failing case) at a
      # 20% MPS share with the LoRA products in fp32 (the default there), with them in bf16 (the
      # control: cuBLAS's fault, bench/results/diagnostic/session11/), and on the whole GPU
      for fp32 in auto 0; do
        run "split_check_20_fp32$fp32" "$top/split_check_20_fp32$fp32.log" env COSERVE_LORA_FP32_MM=$fp32 \
          CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20 python3 bench/split_step_check.py --layers 4 --rows 9 --repeats 2 \
          --out "$top/split_check_20_fp32$fp32.json"
      done
      run split_check_100 "$top/split_check_100.log" python3 bench/split_step_check.py --layers 4 --rows 9 \
        --repeats 2 --out "$top/split_check_100.json"
      for share in 20 40 50; do  # (where the fault stops: session 12 saw it at 40%, not at 50%; the auto rule is < 50)
        run "skinny_mm_$share" "$top/skinny_mm_$share.log" env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$share \
          python3 bench/skinny_mm_check.py --iters 200 --out "$top/skinny_mm_$share.json"
      done ;;
    mps_ops)
      # the split step's ops one by one against fp32 (bench/mps_op_check.py): whole GPU, 20% share,
      # whole GPU with NaN-filled free memory
      run mps_ops_100 "$top/mps_ops_100.log" python3 bench/mps_op_check.py --out "$top/mps_ops_100.json"
      run mps_ops_20 "$top/mps_ops_20.log" env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=20 python3 bench/mps_op_check.py \
        --out "$top/mps_ops_20.json"
      run mps_ops_100_poison "$top/mps_ops_100_poison.log" python3 bench/mps_op_check.py --poison \
        --out "$top/mps_ops_100_poison.json" ;;
    latency=*)
      share=${1#latency=}; share_flags=(); (( share < 100 )) && share_flags=(--trainer-sm-share "$share")
      latency_bench "$1" "$top/coserve_latency_share$share" "${share_flags[@]}" ;;
    latency_profile) latency_bench "$1" "$top/coserve_latency_profile" --trainer-sm-share 50 --profile-layer0 ;;
    latency_warm) latency_bench "$1" "$top/coserve_latency_warm" --trainer-sm-share 50 --warm-replays 1 ;;
    latency_hold)
      # the 50% latency run with --hold-pause: the pause delay and burst step times against latency=50
      latency_bench "$1" "$top/coserve_latency_hold" --trainer-sm-share 50 --hold-pause ;;
    latency_early=*)
      # the 50% latency run with --early-pause-ms MS (SLOConfig.early_pause_s): the backward paused MS
      # before a decode step's predicted end when a request arrived during it
      latency_bench "$1" "$top/coserve_latency_early${1#latency_early=}" --trainer-sm-share 50 \
        --early-pause-ms "${1#latency_early=}" ;;
    latency_early_hold=*)
      # latency_early=MS with --hold-pause too: the backward stopped before a prefill step both after a
      # decode step (the early pause) and between the steps of a burst (held over)
      latency_bench "$1" "$top/coserve_latency_early_hold${1#latency_early_hold=}" --trainer-sm-share 50 \
        --early-pause-ms "${1#latency_early_hold=}" --hold-pause ;;
    latency_prio)
      # the 50% latency run with the engine on the highest-priority stream and the trainer a
      # below-normal MPS client (--stream-priority high): the decode steps' spread beside the backward
      latency_bench "$1" "$top/coserve_latency_prio" --trainer-sm-share 50 --stream-priority high ;;
    eager)
      run eager_off "$top/eager_cpu_off.log" python3 bench/eager_cpu.py --conditions idle \
        --out "$top/eager_cpu_off.json"
      run eager_on "$top/eager_cpu_on.log" python3 bench/eager_cpu.py --conditions idle --prefill-graphs \
        --out "$top/eager_cpu_on.json" ;;
    eager_spread)
      # one eager step's host time, 200 times each, on an idle host and beside spinning processes:
      # whether a lone engine's host time for the same step varies (session 43: 20-50 ms in the
      # latency runs for the same small eager step, on one CPU, the trainer idle or not)
      run eager_spread "$top/eager_spread.log" python3 bench/eager_cpu.py --conditions idle,hog --iters 200 \
        --shapes "1x96_ctx0+32d,1x448_ctx1024+32d,1x2048_ctx0" --no-profile --out "$top/eager_spread.json" ;;
    state_copy)
      run state_copy "$top/state_copy.log" python3 bench/state_copy_cost.py --device cuda --out "$top/state_copy.json" ;;
    spare_start)
      run spare_start "$top/spare_start.log" python3 bench/spare_start.py --out "$top/spare_start.json" ;;
    eager_small)  # the piecewise graphs' small steps (a short chunk beside 32 decodes): host time, profiles
      run eager_small "$top/eager_cpu_small.log" python3 bench/eager_cpu.py --conditions idle --prefill-graphs \
        --shapes "1x512_ctx0,1x96_ctx0+32d,1x96_ctx1024+32d,1x448_ctx1024+32d" --out "$top/eager_cpu_small.json" ;;
    decode_longest)  # decode steps at the same rows and total KV, rows of one length or of many
      run decode_longest "$top/decode_longest.log" python3 bench/decode_longest.py --out "$top/decode_longest.json" ;;
    prefill_context)
      # the paged prefill kernel with its cached prefix in splits and without, one layer at the 8B
      # shape: a short chunk over a long prefix (bench/prefill_context.py, COSERVE_PREFILL_SPLITS)
      run prefill_context "$top/prefill_context.log" python3 bench/prefill_context.py \
        --out "$top/prefill_context.json" ;;
    trainer_first_tasks)
      # the trainer's host stretches over its first 120 tasks (session 35's shapes) by warm-up
      run trainer_first_tasks "$top/trainer_first_tasks.log" python3 bench/trainer_first_tasks.py \
        --tasks-from bench/results/latency_h100/session35/coserve_latency_warm_73d0818.json.xz --layers 8 \
        --tasks 120 --variants "one shapes one:CUDA_MODULE_LOADING=EAGER" --out "$top/trainer_first_tasks.json" ;;
    prefill_fresh)
      # a short chunk over a long prefix beside a fresh chunk (a paged-only step at 400, one with a
      # flash row at 1,024): the split rules against each other (COSERVE_PREFILL_SPLIT_TILES)
      run prefill_fresh "$top/prefill_fresh.log" python3 bench/prefill_context.py --chunks 8,16,64 \
        --contexts 2048,4096,8192 --fresh 400,1024 --out "$top/prefill_fresh.json" ;;
    prefix_cache)
      # automatic prefix caching on the 8B shape: 20 requests sharing a 2,048-token system prompt, each
      # with its own 128 tokens, one after another, with the cache and without (bench/prefix_cache.py)
      run prefix_cache "$top/prefix_cache.log" python3 bench/prefix_cache.py --model shape:llama3-8b --device cuda \
        --shared 2048 --own 128 --requests 20 --out "$top/prefix_cache.json" ;;
    jobs_replay|jobs_replay_switch=*|jobs_resume)
      # a fine-tuning job created through the API (upload, create, pause, resume, cancel) while
      # coserve serve answers a burst-light replay on the 8B shape, against the same replay with no
      # job: per job phase, attainment and TTFT/TPOT p99, and the routes' times (bench/jobs_during_replay.py);
      # the device has no FastAPI/uvicorn: run bench/server_wheels.sh here first and carry .whl.
      # (80 s, the pause at 40: session 43's H100 took ~19 s to set the job up, so a pause at 30 of
      # a job created at 10 came during its set-up, and a resume's set-up takes as long again)
      model_dir=$(python3 -c "from pathlib import Path; from coserve.bench.shapes import materialize; \
print(materialize('shape:llama3-8b', Path('$top/shape')))")
      name=jobs_replay extra=() times=(--duration 80 --job-at 10 --pause-at 40 --resume-at 46 --drain 60)
      if [[ $1 == jobs_resume ]]; then
        name=jobs_resume times=(--duration 50 --job-at 5 --pause-at 28 --resume-at 31 --drain 30)
      fi
      if [[ $1 == jobs_replay_switch=* ]]; then
        name="jobs_replay_switch${1#jobs_replay_switch=}" extra=(--switch-interval-ms "${1#jobs_replay_switch=}")
      fi
      run "$name" "$top/$name.log" python3 bench/jobs_during_replay.py --out "$top/$name.json" \
        --workload burst-light "${times[@]}" --rate-scale 0.833 --max-prompt 4096 --max-output 512 \
        --ttft-slo-ms 1000 --tpot-slo-ms 100 --synthetic 2000:spread:256-1024 --validation-rows 64 --n-epochs 1 \
        -- --model "$model_dir" --served-model-name llama3-8b --load-format dummy --device cuda \
        --max-model-len 8192 --max-num-batched-tokens 2048 --max-loras 4 --gpu-memory-utilization 0.7 \
        --lora-rank 16 --target-modules q_proj,k_proj,v_proj,o_proj --ttft-slo-ms 1000 --tpot-slo-ms 100 \
        --max-seq-len 1024 --save-every 0 "${extra[@]}"
      rm -rf "$top/shape" ;;
    eval=*)
      GPUS=$CUDA_VISIBLE_DEVICES OUT=$top run "$1" "$top/eval_${1#eval=}.log" bench/eval_device.sh "${1#eval=}" ;;
    *) echo "unknown job $1" | tee -a "$top/status.txt" ;;
  esac
}

(( $# )) || set -- "verify latency" "trace_coserve" "trace_peer" "grid eager"
# H100_LANES ("LANE0 JOBS|LANE1 JOBS..."): the lanes to run instead where the GPU is no H200, so that
# a call asked for an H200 still runs what was planned for an H100 if one comes in its place
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
echo "gpu: ${gpu_name:-unknown}" | tee -a "$top/status.txt"
if [[ -n ${H100_LANES:-} && $gpu_name != *H200* ]]; then
  IFS='|' read -r -a h100_lanes <<< "$H100_LANES"
  set -- "${h100_lanes[@]}"
  echo "no H200: the lanes of H100_LANES" | tee -a "$top/status.txt"
fi
gpu=0
for lane in "$@"; do
  (
    export CUDA_VISIBLE_DEVICES=$gpu
    for name in $lane; do job "$name"; done
  ) &
  gpu=$(( gpu + 1 ))
done
wait
cat "$top/status.txt"
tail -n 4 "$top"/*.log "$top"/verify/*.log 2>/dev/null
tar -czf "$OUT/first.tar.gz" -C "$OUT" first && rm -rf "$top"
