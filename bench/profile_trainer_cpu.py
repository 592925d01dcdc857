"""Host (CPU) cost of the trainer's layer-wise recompute backward, per decoder layer.

``task_backward`` on a tiny Llama on the CPU (hidden 64 by default: the matmuls cost next to
nothing, so the time measured is dispatch and Python overhead, what the host spends per layer on
the H200 as well). The layer boundaries that ``task_backward`` already calls
(``at_layer_boundary``) cut the backward into its stretches without touching the code under
test, numbered as the latency run's ``trainer_spans.by_start`` numbers them (``layer#k``: the
stretch from the ``k``-th boundary of a layer to the next; :data:`STRETCHES_UNTRAINED_MLP` says
what each runs in the default layout), and the loss's stretches apart.

Per stretch: the median host time over ``--reps`` runs (``--clock thread``, the default on the
CPU: the calling thread's CPU time, with one intra-op thread, so that the VM's scheduling noise
stays out; ``--clock wall``, the default on CUDA: wall time, as the trainer's spans measure it,
since there autograd runs each backward on its device thread while the calling thread waits;
``--clock process``: the CPU time of all the process's threads, which, beside wall time, tells
host work from a host that waits), the aten ops dispatched (counted with a
``TorchDispatchMode`` in a separate run: the ops below autograd, each one dispatch and, for the
non-view ones, about one kernel launch on the GPU) and the autograd nodes of the graph each
``torch.autograd.backward`` or ``torch.autograd.grad`` walks. Last, the loss and a hash of the
gradient of one task: a change meant to keep the results bit for bit must keep both.

NOTE: on the CPU the attention runs one SDPA call per row length and the torch RMSNorm/RoPE
ops; on CUDA (bf16) one varlen flash call and the fused kernels. ``--same-len`` (one SDPA call)
comes closer to the CUDA path's op count.

``--device cuda`` runs the same on the GPU (``--shape llama3-8b`` for the 8B layer shape) and adds
each part's GPU time: at the task's first boundary a ``torch.cuda._sleep`` of ``--gpu-hold-ms``
holds the stream, so that the CPU queues the whole task before the GPU starts and the CUDA events
recorded at the boundaries measure the kernels back to back (a rep whose hold ran out before the
CPU reached the last boundary is counted in ``hold_too_short``). The host ms is then wall time,
what the trainer's ``TaskResult.spans`` call a stretch's CPU ms. The aten op
counts leave out the Triton kernels (RMSNorm, RoPE), which are no aten ops.

    .venv/bin/python bench/profile_trainer_cpu.py [--same-len] [--dtype bfloat16] [--ops] [--json out.json]
    python3 bench/profile_trainer_cpu.py --device cuda --shape llama3-8b --dtype bfloat16 --rank 16 \
        --rows 5 --min-len 120 --max-len 290 --ops   # ~1,024-token tasks of five row lengths
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import random
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from coserve.bench.provenance import provenance
from coserve.layers.varlen_attention import varlen_impl
from coserve.models.config import ModelConfig
from coserve.models.llama import LlamaForCausalLM
from coserve.models.loader import init_dummy_weights
from coserve.models.peft_adapter import new_lora_adapter
from coserve.trainer.backward import TaskRow, task_backward
from coserve.trainer.lora_params import TrainableLoRA

CLOCK = time.thread_time_ns  # --clock (main sets it)
SHAPES = {"llama3-8b": {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8}}
"""``--shape``: the layer dimensions of a model (its vocabulary stays 256: the loss is no part)."""


def build(args: argparse.Namespace) -> tuple[LlamaForCausalLM, TrainableLoRA, torch.Tensor, list[TaskRow], torch.Tensor | None]:
    cfg = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "hidden_size": args.hidden,
        "intermediate_size": args.intermediate or 2 * args.hidden,
        "num_hidden_layers": args.layers, "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
        "vocab_size": 256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    })
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    model = LlamaForCausalLM(cfg, num_lora_slots=1, max_lora_rank=args.rank, dtype=dtype).to(device)
    init_dummy_weights(model, 0)
    targets = tuple(args.targets.split(","))
    adapter = new_lora_adapter(num_layers=cfg.num_layers, shapes=cfg.linear_shapes(), rank=args.rank,
                               alpha=2 * args.rank, target_modules=targets, seed=0)
    with torch.no_grad():  # B != 0, as after the first optimizer steps
        gen = torch.Generator().manual_seed(1)
        for _, b in adapter.weights.values():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    lora = TrainableLoRA(adapter, dropout=args.dropout, seed=0, device=device)
    rng = random.Random(args.seed)
    # NOTE: rows of one length run the CPU's attention as one SDPA call, as the varlen flash call
    # does on CUDA for rows of any lengths; rows of many lengths add a call per length here.
    lens = [args.max_len if args.same_len else rng.randint(args.min_len, args.max_len) for _ in range(args.rows)]
    rows, off = [], 0
    for n in lens:
        ids = [rng.randrange(256) for _ in range(n)]
        rows.append(TaskRow(off, tuple([-100] * (n // 4) + ids[n // 4 :])))
        off += n
    gen = torch.Generator().manual_seed(2)
    store = torch.randn((cfg.num_layers + 1, off, cfg.hidden_size), generator=gen).to(device, dtype)
    mlp_store = None
    if args.mlp_store:
        mlp_store = torch.randn((cfg.num_layers, off, 2 * cfg.intermediate_size), generator=gen).to(device, dtype)
    return model, lora, store, rows, mlp_store


STRETCHES_UNTRAINED_MLP = ("q/k/v recompute", "attention", "o_proj + residual", "gate/up recompute",
                           "down grad + SwiGLU bwd", "gate/up grad + norm bwd", "o_proj backward",
                           "attention backward", "q/k/v backward")
"""What stretch ``#k`` of a layer runs (the latency run's ``trainer_spans.by_start`` names them
``layer#k``), with the attention in three pieces (the default) and an MLP the adapter does not
train, recomputed from its input. With ``--mlp-store`` the gate/up recompute (``#3``) is not there.
Other layouts (a trained MLP, ``COSERVE_TRAINER_ATTN_PIECES=0``) are listed by number only."""


def stretch_names(count: int, mlp_store: bool) -> tuple[str, ...]:
    """A description for each of a layer's ``count`` stretches (see :data:`STRETCHES_UNTRAINED_MLP`),
    or empty strings where the layout is another one."""
    names: tuple[str, ...] = STRETCHES_UNTRAINED_MLP
    if mlp_store:
        names = names[:3] + names[4:]
    return names if len(names) == count else ("",) * count


STRETCH_RANGE = "stretch:"


class Segments:
    """``at_layer_boundary`` that records each boundary, so that the backward splits into its
    stretches as the trainer's spans do: stretch ``(layer, "#k")`` runs from the ``k``-th boundary
    of ``layer`` to the next boundary (``layer`` = L: the loss's stretches). ``current`` is the
    stretch running since the last call."""

    def __init__(self, num_layers: int, on_switch: Callable[[tuple[int, str]], None] | None = None,
                 gpu_hold_cycles: int = 0, annotate: bool = False) -> None:
        self.num_layers = num_layers
        self.on_switch = on_switch
        self.marks: list[tuple[int, int]] = []  # (layer, CLOCK()) on entry
        self.resumed: list[int] = []  # CLOCK() on return (the events' host time left out of the parts)
        self.keys: list[tuple[int, str]] = []  # the stretch each boundary opens
        self.count: Counter[int] = Counter()  # boundaries per layer so far
        self.current: tuple[int, str] = (num_layers, "#0")
        # CUDA (gpu_hold_cycles > 0): an event at each boundary, the stream held at the first
        self.hold = gpu_hold_cycles
        self.events: list[torch.cuda.Event] = []
        self.held: torch.cuda.Event | None = None
        self.hold_ran_out = False
        # --trace: a profiler range over each stretch (``stretch:<layer>:<k>``)
        self.annotate = annotate
        self._range: Any = None

    def close(self) -> None:
        """End the last stretch's profiler range (``annotate``)."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def __call__(self, layer: int) -> None:
        self.close()
        self.marks.append((layer, CLOCK()))
        if self.hold:
            if self.held is None:
                torch.cuda._sleep(self.hold)
                self.held = torch.cuda.Event()
                self.held.record()
            else:
                self.hold_ran_out = self.held.query()  # the last call's verdict counts
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        self.resumed.append(CLOCK())
        ordinal = self.count[layer]
        self.count[layer] += 1
        self.current = (layer, f"#{ordinal}")
        self.keys.append(self.current)
        if self.annotate:
            self._range = torch.profiler.record_function(f"{STRETCH_RANGE}{layer}:{ordinal}")
            self._range.__enter__()
        if self.on_switch is not None:
            self.on_switch(self.current)

    def split(self, end_ns: int) -> dict[tuple[int, str], float]:
        """Seconds per stretch from the recorded marks (each from a boundary's return to the next
        one's entry; the last one to ``end_ns``)."""
        return self._split([t for _, t in self.marks], self.resumed, end_ns)

    def split_gpu(self, end: torch.cuda.Event) -> dict[tuple[int, str], float]:
        """GPU seconds per stretch from the boundaries' events (``end``: after the task;
        synchronized)."""
        end.synchronize()
        first = self.events[0]
        marks = [round(first.elapsed_time(e) * 1e6) for e in self.events]
        return self._split(marks, marks, round(first.elapsed_time(end) * 1e6))

    def _split(self, marks_ns: list[int], resumed_ns: list[int], end_ns: int) -> dict[tuple[int, str], float]:
        ends = marks_ns[1:] + [end_ns]
        return {key: (stop - began) / 1e9 for key, began, stop in zip(self.keys, resumed_ns, ends, strict=True)}


class PartTimes(NamedTuple):
    host: dict[tuple[int, str], float]  # median seconds per (layer, part)
    host_p90: dict[tuple[int, str], float]
    gpu: dict[tuple[int, str], float]  # median GPU seconds (CUDA; empty on the CPU)
    hold_too_short: int  # CUDA reps whose hold ended before the CPU's last boundary


def time_parts(model: LlamaForCausalLM, lora: TrainableLoRA, store: torch.Tensor, rows: list[TaskRow],
               mlp_store: torch.Tensor | None, args: argparse.Namespace) -> PartTimes:
    samples: dict[tuple[int, str], list[float]] = defaultdict(list)
    gpu: dict[tuple[int, str], list[float]] = defaultdict(list)
    cuda = store.is_cuda
    hold = _sleep_cycles(args.gpu_hold_ms) if cuda else 0
    short = 0
    # NOTE: layer 0's last stretch ends at ``before_readback``, once the task's work is queued: the
    # task's end comes after reading the loss, a sync in which the CPU spins until the GPU is done
    ends: list[tuple[int, torch.cuda.Event | None]] = []

    def queued() -> None:
        event = torch.cuda.Event(enable_timing=True) if cuda else None
        if event is not None:
            event.record()
        ends.append((CLOCK(), event))

    for rep in range(args.warmup + args.reps):
        seg = Segments(len(model.model.layers), gpu_hold_cycles=hold)
        ends.clear()
        task_backward(model, lora, store, rows, dropout_key=7, at_layer_boundary=seg, mlp_store=mlp_store,
                      before_readback=queued)
        end, done = ends[-1]
        if rep >= args.warmup:
            for key, s in seg.split(end).items():
                samples[key].append(s)
            if done is not None:
                short += seg.hold_ran_out
                for key, s in seg.split_gpu(done).items():
                    gpu[key].append(s)
    p90 = {key: statistics.quantiles(v, n=10)[-1] if len(v) > 1 else v[0] for key, v in samples.items()}
    return PartTimes({key: statistics.median(v) for key, v in samples.items()}, p90,
                     {key: statistics.median(v) for key, v in gpu.items()}, short)


def _sleep_cycles(ms: float) -> int:
    """``torch.cuda._sleep`` cycles for about ``ms`` milliseconds (calibrated once)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * ms / start.elapsed_time(end))


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.where: tuple[int, str] = (-1, "")
        self.counts: dict[tuple[int, str], Counter[str]] = defaultdict(Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.counts[self.where][str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _graph_nodes(roots: Any, inputs: Any = None) -> int:
    """Autograd nodes reachable from ``roots``' ``grad_fn`` (AccumulateGrad leaves included, but
    those of ``inputs``, the tensors a ``torch.autograd.grad`` returns the gradients of: it does
    not run their AccumulateGrad)."""
    tensors = [roots] if isinstance(roots, torch.Tensor) else list(roots)
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(n for n, _ in node.next_functions)
    if inputs is not None:
        leaves = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        seen -= {node for node in seen if any(getattr(node, "variable", None) is t for t in leaves)}
    return len(seen)


def count_parts(model: LlamaForCausalLM, lora: TrainableLoRA, store: torch.Tensor, rows: list[TaskRow],
                mlp_store: torch.Tensor | None) -> tuple[dict[tuple[int, str], Counter[str]], dict[tuple[int, str], int]]:
    counter = _OpCounter()
    nodes: dict[tuple[int, str], int] = Counter()
    seg = Segments(len(model.model.layers), on_switch=lambda w: setattr(counter, "where", w))
    original, original_grad = torch.autograd.backward, torch.autograd.grad

    def backward(tensors: Any, grad_tensors: Any = None, *a: Any, **kw: Any) -> None:
        nodes[seg.current] += _graph_nodes(tensors)
        original(tensors, grad_tensors, *a, **kw)

    def grad(outputs: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
        nodes[seg.current] += _graph_nodes(outputs, inputs)
        return original_grad(outputs, inputs, *a, **kw)

    torch.autograd.backward = backward  # type: ignore[assignment]
    torch.autograd.grad = grad
    try:
        with counter:
            task_backward(model, lora, store, rows, dropout_key=7, at_layer_boundary=seg, mlp_store=mlp_store)
    finally:
        torch.autograd.backward, torch.autograd.grad = original, original_grad
    return counter.counts, dict(nodes)


def trace_stretches(model: LlamaForCausalLM, lora: TrainableLoRA, store: torch.Tensor, rows: list[TaskRow],
                    mlp_store: torch.Tensor | None, layer: int, chrome: str | None,
                    top: int = 12) -> dict[str, Any]:
    """One task under ``torch.profiler`` (host activity), a range over each stretch: per stretch of
    ``layer``, the range's length, its self time (the calling thread outside any op: Python, and
    the waits for autograd's device thread on CUDA) and the ``top`` ops by self time among the
    events that start inside it, on any thread (autograd's device thread included: its
    ``autograd::engine::evaluate_function: ...`` events' self time is the node's Python and
    bookkeeping). ``chrome``: also the trace, for chrome://tracing or Perfetto."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if store.is_cuda else [])
    seg = Segments(len(model.model.layers), annotate=True)
    with profile(activities=activities) as prof:
        task_backward(model, lora, store, rows, dropout_key=7, at_layer_boundary=seg, mlp_store=mlp_store)
        seg.close()
        if store.is_cuda:
            torch.cuda.synchronize()
    if chrome:
        prof.export_chrome_trace(chrome)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    ranges = sorted((e.time_range.start, e.time_range.end, e) for e in events if e.name.startswith(STRETCH_RANGE))
    starts = [r[0] for r in ranges]
    ops: dict[str, Counter[str]] = defaultdict(Counter)
    for e in events:
        if e.name.startswith(STRETCH_RANGE):
            continue
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        if i >= 0 and e.time_range.start < ranges[i][1]:
            ops[ranges[i][2].name][e.name] += e.self_cpu_time_total
    out: dict[str, Any] = {}
    for began, ended, e in ranges:
        at_layer, ordinal = e.name[len(STRETCH_RANGE):].split(":")
        if int(at_layer) != layer:
            continue
        out[f"#{ordinal}"] = {
            "range_us": ended - began, "self_us": e.self_cpu_time_total,
            "top_ops_self_us": dict(ops[e.name].most_common(top)),
        }
    return out


def result_digest(model: LlamaForCausalLM, lora: TrainableLoRA, store: torch.Tensor, rows: list[TaskRow],
                  mlp_store: torch.Tensor | None) -> tuple[float, str]:
    """The loss and a hash of the gradient bytes of one task from a zero gradient: a change that
    keeps the results bit for bit keeps both (same machine, same thread count)."""
    assert lora.flat.grad is not None
    lora.flat.grad.zero_()
    out = task_backward(model, lora, store, rows, dropout_key=7, mlp_store=mlp_store)
    return out.loss_sum, hashlib.sha256(lora.flat.grad.cpu().numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=0, help="the MLP's width (0: twice --hidden)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="a model's layer dimensions (overrides --hidden/--intermediate/--heads/--kv-heads)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: also each part's GPU time")
    p.add_argument("--gpu-hold-ms", type=float, default=200.0,
                   help="CUDA: how long the stream is held at the task's first boundary")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's dtype")
    p.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--min-len", type=int, default=4)
    p.add_argument("--max-len", type=int, default=24)
    p.add_argument("--same-len", action="store_true",
                   help="every row --max-len tokens long: one SDPA call per layer, like CUDA's varlen call")
    p.add_argument("--mlp-store", action="store_true", help="pass the saved gate/up outputs (as the engine keeps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier host timings)")
    p.add_argument("--clock", choices=["thread", "wall", "process"], default=None,
                   help="host time as the calling thread's CPU time, as wall time or as the CPU time of all "
                        "the process's threads (default: thread on the CPU, wall on CUDA, where autograd's "
                        "backward runs on another thread)")
    p.add_argument("--ops", action="store_true", help="also list the aten ops of each part of one layer")
    p.add_argument("--trace", action="store_true",
                   help="also one task under torch.profiler: per stretch of one layer, its ops by self host time")
    p.add_argument("--chrome-trace", default=None, help="with --trace: write the profiler's trace here")
    p.add_argument("--json", default=None, help="write the figures with provenance as JSON here")
    args = p.parse_args()
    if args.shape is not None:
        for name, value in SHAPES[args.shape].items():
            setattr(args, name, value)
    torch.set_num_threads(args.threads)
    global CLOCK
    if args.clock is None:
        args.clock = "wall" if args.device.startswith("cuda") else "thread"
    CLOCK = {"wall": time.perf_counter_ns, "thread": time.thread_time_ns, "process": time.process_time_ns}[args.clock]

    model, lora, store, rows, mlp_store = build(args)
    num_layers = len(model.model.layers)
    timed = time_parts(model, lora, store, rows, mlp_store, args)
    times, gpu = timed.host, timed.gpu
    counts, nodes = count_parts(model, lora, store, rows, mlp_store)
    loss, digest = result_digest(model, lora, store, rows, mlp_store)

    lens = [len(r.labels) for r in rows]
    impl = varlen_impl()
    attention = "CPU: SDPA per row length" if not store.is_cuda else f"varlen {impl[0] if impl else 'off'}"
    print(f"{num_layers} layers on {args.device}, {args.dtype}, hidden {args.hidden}, intermediate "
          f"{args.intermediate or 2 * args.hidden}, heads {args.heads}/{args.kv_heads}, rank {args.rank}, "
          f"targets {args.targets}, dropout {args.dropout}, rows {lens} ({sum(lens)} tokens, "
          f"{len(set(lens))} lengths), attention {attention}, median of {args.reps}")
    if gpu:
        print(f"GPU held {args.gpu_hold_ms:.0f} ms at each task's start; reps where the hold ran out before the CPU's "
              f"last boundary: {timed.hold_too_short} of {args.reps}")
    layers = range(num_layers)
    parts = [part for layer, part in times if layer == num_layers - 1]  # a layer's stretches, in order
    names = dict(zip(parts, stretch_names(len(parts), mlp_store is not None), strict=True))
    print(f"{'layer':>5} {'part':>4} {'':<24} {'host ms':>8} {'host p90':>8} {'gpu ms':>7} {'aten ops':>9} {'ag nodes':>9}")
    per_layer: list[dict[str, Any]] = []
    for layer in [num_layers, *range(num_layers - 1, -1, -1)]:
        for key in [k for k in times if k[0] == layer]:
            part = key[1]
            ops = sum(counts.get(key, Counter()).values())
            gpu_ms = f"{gpu[key] * 1e3:7.3f}" if gpu else f"{'-':>7}"
            label = "loss" if layer == num_layers else names.get(part, "")
            print(f"{'loss' if layer == num_layers else layer:>5} {part:>4} {label:<24} {times[key] * 1e3:8.3f} "
                  f"{timed.host_p90[key] * 1e3:8.3f} {gpu_ms} {ops:9d} {nodes.get(key, 0):9d}")
            per_layer.append({"layer": layer, "part": part, "name": label, "host_ms": times[key] * 1e3,
                              "host_p90_ms": timed.host_p90[key] * 1e3,
                              "gpu_ms": gpu[key] * 1e3 if gpu else None, "aten_ops": ops,
                              "autograd_nodes": nodes.get(key, 0)})
    # (means over the layers, by stretch; the loss's stretches apart)
    mean = {part: statistics.fmean(times[(layer, part)] for layer in layers) * 1e3 for part in parts}
    mean_ops = {part: statistics.fmean(sum(counts.get((layer, part), Counter()).values()) for layer in layers)
                for part in parts}
    mean_nodes = {part: statistics.fmean(nodes.get((layer, part), 0) for layer in layers) for part in parts}
    mean_gpu = {part: statistics.fmean(gpu[(layer, part)] for layer in layers) * 1e3 for part in parts} if gpu else {}
    print("mean per layer:")
    for part in parts:
        ratio = f", host/GPU {mean[part] / mean_gpu[part]:.2f}" if gpu and mean_gpu[part] > 0 else ""
        gpu_part = f", GPU {mean_gpu[part]:.3f} ms{ratio}" if gpu else ""
        print(f"  {part:>3} {names[part]:<24} host {mean[part]:.3f} ms{gpu_part}, {mean_ops[part]:.1f} aten ops, "
              f"{mean_nodes[part]:.1f} autograd nodes")
    total_gpu = f", GPU {sum(mean_gpu.values()):.3f} ms" if gpu else ""
    print(f"layer total: host {sum(mean.values()):.3f} ms{total_gpu}, {sum(mean_ops.values()):.1f} aten ops")
    print(f"loss {loss!r}, gradient sha256 {digest}")
    # the ops of a layer past the first one processed (that one also makes the task's one-off tables)
    shown = max(num_layers - 2, 0)
    if args.ops:
        for part in parts:
            print(f"-- layer {shown} {part} {names[part]}: "
                  + ", ".join(f"{n} {c}" for n, c in counts[(shown, part)].most_common()))
    traced: dict[str, Any] | None = None
    if args.trace:
        traced = trace_stretches(model, lora, store, rows, mlp_store, shown, args.chrome_trace)
        print(f"-- layer {shown} under torch.profiler (us: the range / the calling thread outside ops; top ops by self time)")
        for part, t in traced.items():
            print(f"  {part:>3} {names.get(part, ''):<24} {t['range_us']:8.0f} / {t['self_us']:6.0f}: "
                  + ", ".join(f"{n} {us:.0f}" for n, us in list(t["top_ops_self_us"].items())[:8]))
    if args.json:
        figures = {"trace": traced, "row_lens": lens, "attention": attention, "parts": per_layer, "mean_host_ms": mean,
                   "mean_gpu_ms": mean_gpu, "hold_too_short": timed.hold_too_short, "mean_aten_ops": mean_ops,
                   "mean_autograd_nodes": mean_nodes, "loss_sum": loss, "grad_sha256": digest, "ops_layer": shown,
                   "stretch_names": names, "ops": {part: dict(counts[(shown, part)]) for part in parts}}
        with open(args.json, "w") as f:
            json.dump({**provenance(), "config": vars(args), "figures": figures}, f, indent=1)


if __name__ == "__main__":
    main()
