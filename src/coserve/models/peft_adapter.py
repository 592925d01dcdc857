"""Reading and writing LoRA adapters in the Hugging Face PEFT on-disk format.

An adapter directory holds ``adapter_config.json`` (a PEFT ``LoraConfig``) and
``adapter_model.safetensors`` (or the legacy ``adapter_model.bin``). Only plain LoRA on the
linear layers of a Llama-family decoder (Llama, Mistral, Qwen2) is supported: the targets are
the Hugging Face module names in :data:`LORA_TARGETS`, one ``(A, B)`` pair per decoder layer and
target. For a base linear with weight ``[out, in]`` the adapter adds
``(x @ A.T @ B.T) * scaling`` with ``A: [r, in]``, ``B: [out, r]`` and
``scaling = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA).

Everything that would change that math (DoRA, trained biases, ``modules_to_save``, per-layer
rank/alpha patterns, initialisations that rewrite the base weights, ...) is rejected with an
:class:`AdapterError` instead of being silently ignored.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

logger = logging.getLogger(__name__)

LORA_TARGETS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"

# The submodule of a decoder layer that holds each target.
_PARENT: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}

# PEFT's state-dict key: optional PeftModel prefix, optional adapter-name infix.
_KEY_RE = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<target>\w+)"
    r"\.lora_(?P<ab>[AB])(?:\.(?P<name>[^.]+))?\.weight$"
)
_LORA_MODULE_RE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)\.lora_")

# Linear modules of the model that exist but cannot carry a LoRA here; a config that selects
# them would make PEFT adapt them.
_UNSUPPORTED_MODULE_PATHS: tuple[str, ...] = ("lm_head", "model.embed_tokens")

# Config fields whose presence (any non-empty value) changes the adapter's math or structure.
_UNSUPPORTED_IF_SET: tuple[tuple[str, str], ...] = (
    ("use_dora", "DoRA (use_dora: true) is not supported"),
    ("fan_in_fan_out", "fan_in_fan_out: true (transposed Conv1D-style weights) is not supported"),
    (
        "modules_to_save",
        "modules_to_save is not supported: the adapter carries full copies of base-model modules",
    ),
    (
        "layers_to_transform",
        "layers_to_transform is not supported yet: only adapters on every "
        "decoder layer can be served",
    ),
    ("rank_pattern", "rank_pattern (per-module ranks) is not supported yet"),
    ("alpha_pattern", "alpha_pattern (per-module alphas) is not supported yet"),
    ("lora_bias", "lora_bias: true (a trained bias on lora_B) is not supported"),
    ("use_qalora", "QA-LoRA (use_qalora: true) is not supported"),
    (
        "trainable_token_indices",
        "trainable_token_indices (trained embedding rows) is not supported",
    ),
    ("target_parameters", "target_parameters (LoRA on raw parameters) is not supported"),
    ("layer_replication", "layer_replication is not supported"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens) is not supported"),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora) is not supported"),
    ("arrow_config", "Arrow routing (arrow_config) is not supported"),
    ("kasa_config", "KaSA (kasa_config) is not supported"),
    ("velora_config", "VeLoRA (velora_config) is not supported"),
    ("monteclora_config", "MonteCLoRA (monteclora_config) is not supported"),
)

# These initialisations rewrite the base weights, so the saved A/B are only correct on top of
# that rewritten base. PEFT's save_pretrained(path_initial_model_for_weight_conversion=...)
# converts such an adapter into a plain one (and then records init_lora_weights: true).
_BASE_MODIFYING_INITS: tuple[str, ...] = ("pissa", "olora", "corda", "loftq", "lora_ga")


class AdapterError(ValueError):
    """A LoRA adapter directory is unreadable, unsupported, or does not fit the model.

    The message names the directory (where there is one) and the problem.
    """


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A LoRA adapter for the linear layers of a Llama-family decoder.

    Invariants (checked on construction, ``ValueError`` otherwise):

    * ``rank > 0``; ``alpha`` finite.
    * ``target_modules`` is a non-empty subset of :data:`LORA_TARGETS`, in that order.
    * ``weights`` has exactly one entry per ``(layer, target)`` for ``layer in range(num_layers)``
      and ``target in target_modules``: ``(A, B)`` with ``A: [rank, in]`` and ``B: [out, rank]``,
      2-D float32 CPU tensors; ``in``/``out`` are the same on every layer for a given target.

    ``weights`` is a plain dict for convenience; treat it as read-only. An int ``alpha`` is
    stored as float. Equality is identity (comparing tensors element-wise is the caller's
    business), and ``repr`` leaves the tensors out.
    """

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    use_rslora: bool
    base_model_name_or_path: str | None
    num_layers: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"rank must be a positive int, got {self.rank!r}")
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, int | float)
            or not math.isfinite(self.alpha)
        ):
            raise ValueError(f"alpha must be a finite number, got {self.alpha!r}")
        # An int alpha (as in PEFT configs) is accepted; store the declared float.
        object.__setattr__(self, "alpha", float(self.alpha))
        _check_targets(self.target_modules)
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {self.num_layers}")
        expected = {(i, t) for i in range(self.num_layers) for t in self.target_modules}
        if set(self.weights) != expected:
            missing = sorted(expected - set(self.weights))
            extra = sorted(set(self.weights) - expected)
            raise ValueError(
                f"weights must cover layers 0..{self.num_layers - 1} x {list(self.target_modules)}"
                f" exactly; missing {_fmt_pairs(missing)}, unexpected {_fmt_pairs(extra)}"
            )
        dims: dict[str, tuple[int, int]] = {}
        for (layer, target), (a, b) in sorted(self.weights.items()):
            for ab, t in (("lora_A", a), ("lora_B", b)):
                if t.dim() != 2:
                    raise ValueError(
                        f"layer {layer} {target} {ab} must be 2-D, got shape {list(t.shape)}"
                    )
                if t.dtype != torch.float32 or t.device.type != "cpu":
                    raise ValueError(
                        f"layer {layer} {target} {ab} must be a float32 CPU tensor, "
                        f"got {t.dtype} on {t.device}"
                    )
            if a.shape[0] != self.rank:
                raise ValueError(
                    f"layer {layer} {target} lora_A has shape {list(a.shape)}: its rank "
                    f"{a.shape[0]} differs from r={self.rank}"
                )
            if b.shape[1] != self.rank:
                raise ValueError(
                    f"layer {layer} {target} lora_B has shape {list(b.shape)}: its rank "
                    f"{b.shape[1]} differs from r={self.rank}"
                )
            out_in = (b.shape[0], a.shape[1])
            first = dims.setdefault(target, out_in)
            if out_in != first:
                raise ValueError(
                    f"layer {layer} {target} has (out, in) = {out_in} but layer 0 has {first}: "
                    "all layers of a target must have the same shape"
                )

    @property
    def scaling(self) -> float:
        """The factor applied to ``x @ A.T @ B.T``: ``alpha / r``, or ``alpha / sqrt(r)``."""
        if self.use_rslora:
            return self.alpha / math.sqrt(self.rank)
        return self.alpha / self.rank


# --------------------------------------------------------------------------------------------
# Loading


def load_peft_adapter(path: str | Path) -> LoraAdapter:
    """Load a PEFT LoRA adapter directory into a :class:`LoraAdapter`.

    Reads ``adapter_config.json`` and ``adapter_model.safetensors`` (falling back to
    ``adapter_model.bin``, loaded with ``torch.load(weights_only=True)``). Keys may carry the
    ``base_model.model.`` prefix or not, and an adapter-name infix (``lora_A.default.weight``).
    The effective targets are those present in the weights; they must agree with the config's
    ``target_modules`` (list, ``"all-linear"``, or a regex, with PEFT's matching rules) and
    cover every layer ``0..num_layers-1``. All tensors are returned as float32 CPU tensors.

    Raises:
        AdapterError: naming ``path`` and the problem, for anything missing, malformed or
            unsupported.
    """
    root = Path(path)
    if not root.exists():
        raise AdapterError(f"adapter directory {root} does not exist")
    if not root.is_dir():
        raise AdapterError(f"adapter path {root} is not a directory")
    cfg = _read_config(root)
    tensors = _read_tensors(root)
    adapter = _build_adapter(root, cfg, tensors)
    logger.info(
        "loaded LoRA adapter %s: rank %d, alpha %g, %d layers, targets %s",
        root,
        adapter.rank,
        adapter.alpha,
        adapter.num_layers,
        ",".join(adapter.target_modules),
    )
    return adapter


@dataclass(frozen=True)
class _Config:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: list[str] | str | None
    exclude_modules: list[str] | str | None
    base_model_name_or_path: str | None


def _read_config(root: Path) -> _Config:
    cfg_path = root / CONFIG_NAME
    if not cfg_path.is_file():
        raise AdapterError(f"adapter directory {root} has no {CONFIG_NAME}")
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"adapter {root}: {CONFIG_NAME} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise AdapterError(f"adapter {root}: {CONFIG_NAME} must hold a JSON object")

    def fail(msg: str) -> AdapterError:
        return AdapterError(f"adapter {root}: {msg}")

    peft_type = raw.get("peft_type")
    if peft_type != "LORA":
        raise fail(f"peft_type is {peft_type!r}; only 'LORA' adapters are supported")
    for key, reason in _UNSUPPORTED_IF_SET:
        if _is_set(raw.get(key)):
            raise fail(f"{reason} (got {key}={raw[key]!r})")
    bias = raw.get("bias", "none")
    if bias not in (None, "none"):
        raise fail(f"bias={bias!r} is not supported (only 'none'): the adapter trains biases")
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise fail(
            f"init_lora_weights={init!r} rewrites the base weights, so this adapter only works "
            "on that rewritten base; convert it with PEFT's save_pretrained("
            "path_initial_model_for_weight_conversion=...)"
        )

    rank = raw.get("r", 8)  # PEFT's defaults, for hand-written configs
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise fail(f"r must be a positive integer, got {rank!r}")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise fail(f"lora_alpha must be a finite number, got {alpha!r}")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise fail(f"use_rslora must be true or false, got {use_rslora!r}")
    base = raw.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise fail(f"base_model_name_or_path must be a string or null, got {base!r}")
    targets = _read_module_selector(raw, "target_modules", fail)
    if isinstance(targets, list):
        for entry in targets:
            if entry.rsplit(".", 1)[-1] not in LORA_TARGETS:
                raise fail(
                    f"target_modules contains {entry!r}, which is not supported: only "
                    f"{', '.join(LORA_TARGETS)} can carry a LoRA"
                )
    elif isinstance(targets, str) and targets.lower() != "all-linear":
        for module in _UNSUPPORTED_MODULE_PATHS:
            if re.fullmatch(targets, module):
                raise fail(
                    f"target_modules regex {targets!r} selects {module!r}, which is not "
                    f"supported: only {', '.join(LORA_TARGETS)} can carry a LoRA"
                )
    return _Config(
        rank=rank,
        alpha=float(alpha),
        use_rslora=use_rslora,
        target_modules=targets,
        exclude_modules=_read_module_selector(raw, "exclude_modules", fail),
        base_model_name_or_path=base,
    )


def _read_module_selector(raw: Mapping[str, Any], key: str, fail: Any) -> list[str] | str | None:
    """A PEFT module selector: ``None``, a regex string, or a list of module-name suffixes."""
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as e:
            raise fail(f"{key} {value!r} is not a valid regex: {e}") from e
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise fail(f"{key} must be a list of names or a regex string, got {value!r}")


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    st_path = root / SAFETENSORS_NAME
    bin_path = root / BIN_NAME
    if st_path.is_file():
        try:
            return safetensors.torch.load_file(str(st_path), device="cpu")
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise AdapterError(f"adapter {root}: cannot read {SAFETENSORS_NAME}: {e}") from e
    if bin_path.is_file():
        try:
            loaded = torch.load(str(bin_path), map_location="cpu", weights_only=True)
        except Exception as e:  # unpickling errors come in many types
            raise AdapterError(f"adapter {root}: cannot read {BIN_NAME}: {e}") from e
        if not isinstance(loaded, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
        ):
            raise AdapterError(f"adapter {root}: {BIN_NAME} is not a dict of name -> tensor")
        return loaded
    raise AdapterError(
        f"adapter directory {root} has no weights file ({SAFETENSORS_NAME} or {BIN_NAME})"
    )


def _build_adapter(root: Path, cfg: _Config, tensors: Mapping[str, torch.Tensor]) -> LoraAdapter:
    def fail(msg: str) -> AdapterError:
        return AdapterError(f"adapter {root}: {msg}")

    if not tensors:
        raise fail("the weights file holds no tensors")
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    names: set[str | None] = set()
    for key, tensor in tensors.items():
        m = _KEY_RE.match(key)
        if m is None:
            lm = _LORA_MODULE_RE.match(key)
            module = lm.group("module") if lm else None
            if module is not None and module.rsplit(".", 1)[-1] not in LORA_TARGETS:
                raise fail(
                    f"tensor {key!r} is a LoRA on {module!r}, which is not supported: only "
                    f"{', '.join(LORA_TARGETS)} can carry a LoRA"
                )
            raise fail(
                f"unexpected tensor {key!r}: expected only keys like "
                "'base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight'"
            )
        layer, parent, target, ab = (
            int(m.group("layer")),
            m.group("parent"),
            m.group("target"),
            m.group("ab"),
        )
        if target not in LORA_TARGETS:
            raise fail(
                f"tensor {key!r} is a LoRA on {target!r}, which is not supported: only "
                f"{', '.join(LORA_TARGETS)} can carry a LoRA"
            )
        if parent != _PARENT[target]:
            raise fail(f"tensor {key!r}: {target} should be under {_PARENT[target]}, not {parent}")
        if (layer, target, ab) in halves:
            raise fail(f"tensor {key!r} duplicates layer {layer} {target} lora_{ab}")
        if tensor.dim() != 2:
            raise fail(f"tensor {key!r} must be 2-D, got shape {list(tensor.shape)}")
        if not tensor.is_floating_point():
            raise fail(f"tensor {key!r} has dtype {tensor.dtype}; expected a floating-point type")
        names.add(m.group("name"))
        halves[(layer, target, ab)] = tensor
    if len(names) > 1:
        shown = sorted("<none>" if n is None else n for n in names)
        raise fail(f"the weights hold tensors of several adapters ({', '.join(shown)})")

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, target, ab), tensor in halves.items():
        other = "B" if ab == "A" else "A"
        if (layer, target, other) not in halves:
            raise fail(f"layer {layer} {target} has lora_{ab} but no lora_{other}")
        if ab == "A":
            a = tensor.to(device="cpu", dtype=torch.float32).contiguous()
            b = halves[(layer, target, "B")].to(device="cpu", dtype=torch.float32).contiguous()
            if a.shape[0] != cfg.rank or b.shape[1] != cfg.rank:
                raise fail(
                    f"layer {layer} {target}: lora_A {list(a.shape)} / lora_B {list(b.shape)} "
                    f"do not have rank r={cfg.rank} from {CONFIG_NAME}"
                )
            weights[(layer, target)] = (a, b)

    present = set(weights)
    num_layers = max(layer for layer, _ in present) + 1
    targets = tuple(t for t in LORA_TARGETS if any(t == pt for _, pt in present))
    if cfg.target_modules is not None:
        selected = {
            (i, t)
            for i in range(num_layers)
            for t in LORA_TARGETS
            if _peft_selects(cfg, f"model.layers.{i}.{_PARENT[t]}.{t}")
        }
        if selected != present:
            missing = sorted(selected - present)
            extra = sorted(present - selected)
            parts = []
            if missing:
                parts.append(f"it selects {_fmt_pairs(missing)} but the weights lack them")
            if extra:
                parts.append(f"the weights have {_fmt_pairs(extra)} which it does not select")
            raise fail(
                f"weights do not match target_modules={cfg.target_modules!r}: " + "; ".join(parts)
            )
    full = {(i, t) for i in range(num_layers) for t in targets}
    if present != full:
        raise fail(
            f"the adapter covers only some layers (missing {_fmt_pairs(sorted(full - present))});"
            " adapters on a subset of layers are not supported yet"
        )
    try:
        return LoraAdapter(
            rank=cfg.rank,
            alpha=cfg.alpha,
            target_modules=targets,
            use_rslora=cfg.use_rslora,
            base_model_name_or_path=cfg.base_model_name_or_path,
            num_layers=num_layers,
            weights=weights,
        )
    except ValueError as e:
        raise fail(str(e)) from e


def _peft_selects(cfg: _Config, module: str) -> bool:
    """Whether PEFT would put a LoRA on ``module`` (a path like ``model.layers.0.mlp.up_proj``)."""
    if cfg.exclude_modules is not None and _matches(cfg.exclude_modules, module):
        return False
    targets = cfg.target_modules
    if isinstance(targets, str) and targets.lower() == "all-linear":
        # For these models "all-linear" means every linear except the output head.
        return True
    return targets is not None and _matches(targets, module)


def _matches(selector: list[str] | str, module: str) -> bool:
    # PEFT: a string is a regex matched against the whole path; list entries are name suffixes.
    if isinstance(selector, str):
        return re.fullmatch(selector, module) is not None
    return any(module == s or module.endswith("." + s) for s in selector)


def _is_set(value: object) -> bool:
    if value is None or value is False:
        return False
    if isinstance(value, str | list | dict | tuple) and len(value) == 0:
        return False
    return True


def _fmt_pairs(pairs: Sequence[tuple[int, str]], limit: int = 6) -> str:
    if not pairs:
        return "none"
    shown = ", ".join(f"layer {i} {t}" for i, t in pairs[:limit])
    more = f" and {len(pairs) - limit} more" if len(pairs) > limit else ""
    return f"[{shown}{more}]"


def _check_targets(target_modules: Sequence[str]) -> None:
    if not target_modules:
        raise ValueError("target_modules must not be empty")
    unknown = [t for t in target_modules if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; supported: {list(LORA_TARGETS)}")
    ordered = tuple(t for t in LORA_TARGETS if t in target_modules)
    if tuple(target_modules) != ordered:
        raise ValueError(
            f"target_modules must be distinct and in LORA_TARGETS order {ordered}, "
            f"got {tuple(target_modules)}"
        )


# --------------------------------------------------------------------------------------------
# Checking against a model


def check_adapter_fits(
    adapter: LoraAdapter,
    *,
    num_layers: int,
    shapes: Mapping[str, tuple[int, int]],
    max_rank: int,
    path: str | Path | None = None,
) -> None:
    """Check that ``adapter`` can be applied to a base model.

    Args:
        num_layers: decoder layers in the base model.
        shapes: target -> ``(out_features, in_features)`` of the base model's linear.
        max_rank: largest LoRA rank the server accepts.
        path: where the adapter came from, for messages.

    An adapter covering fewer layers than the model is accepted (the remaining layers get no
    LoRA). Raises :class:`AdapterError` if the rank exceeds ``max_rank``, a target is not in
    ``shapes``, the adapter has weights for a layer ``>= num_layers``, or an A/B shape does not
    match the model (which means it was trained for another base model).
    """
    where = f"adapter {path}" if path is not None else "adapter"
    if adapter.base_model_name_or_path:
        where += f" (trained on {adapter.base_model_name_or_path})"
    if adapter.rank > max_rank:
        raise AdapterError(
            f"{where}: rank {adapter.rank} exceeds the maximum LoRA rank {max_rank} of this server"
        )
    for target in adapter.target_modules:
        if target not in shapes:
            raise AdapterError(
                f"{where}: targets {target!r}, which this model does not adapt "
                f"(known targets: {', '.join(shapes)})"
            )
    if adapter.num_layers > num_layers:
        raise AdapterError(
            f"{where}: has weights for layer {adapter.num_layers - 1} but the model has only "
            f"{num_layers} layers; the adapter was trained for another base model"
        )
    for (layer, target), (a, b) in sorted(adapter.weights.items()):
        out_features, in_features = shapes[target]
        for name, got, want in (
            ("lora_A", tuple(a.shape), (adapter.rank, in_features)),
            ("lora_B", tuple(b.shape), (out_features, adapter.rank)),
        ):
            if got != want:
                raise AdapterError(
                    f"{where}: layer {layer} {target} {name} has shape {list(got)}, expected "
                    f"{list(want)} for the model's {target} [out={out_features}, "
                    f"in={in_features}]; the adapter was trained for another base model"
                )
    if adapter.num_layers < num_layers:
        logger.warning(
            "%s covers %d of the model's %d layers; the rest get no LoRA",
            where,
            adapter.num_layers,
            num_layers,
        )


# --------------------------------------------------------------------------------------------
# Creating


def new_lora_adapter(
    *,
    num_layers: int,
    shapes: Mapping[str, tuple[int, int]],
    rank: int,
    alpha: float,
    target_modules: Sequence[str],
    use_rslora: bool = False,
    seed: int = 0,
    base_model_name_or_path: str | None = None,
) -> LoraAdapter:
    """A freshly initialised adapter, like PEFT's ``init_lora_weights=True``.

    ``A ~ kaiming_uniform_(a=sqrt(5))`` (the ``nn.Linear`` default), ``B = 0``, so the adapter
    starts as a no-op. ``A`` tensors are drawn from one ``torch.Generator`` seeded ``seed``,
    layer by layer and target by target in :data:`LORA_TARGETS` order, so the result depends
    only on the arguments. ``target_modules`` may come in any order; ``shapes`` maps each
    target to ``(out_features, in_features)``.

    Raises:
        ValueError: unknown or duplicate targets, a target missing from ``shapes``, or a
            non-positive ``rank``/``num_layers``.
    """
    if len(set(target_modules)) != len(target_modules):
        raise ValueError(f"duplicate entries in target_modules {list(target_modules)}")
    unknown = [t for t in target_modules if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"unknown LoRA targets {unknown}; supported: {list(LORA_TARGETS)}")
    targets = tuple(t for t in LORA_TARGETS if t in target_modules)
    missing = [t for t in targets if t not in shapes]
    if missing:
        raise ValueError(f"no shape given for targets {missing}")
    if isinstance(rank, bool) or rank <= 0:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in range(num_layers):
        for target in targets:
            out_features, in_features = shapes[target]
            a = torch.empty(rank, in_features, dtype=torch.float32)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            b = torch.zeros(out_features, rank, dtype=torch.float32)
            weights[(layer, target)] = (a, b)
    return LoraAdapter(
        rank=rank,
        alpha=float(alpha),
        target_modules=targets,
        use_rslora=use_rslora,
        base_model_name_or_path=base_model_name_or_path,
        num_layers=num_layers,
        weights=weights,
    )


# --------------------------------------------------------------------------------------------
# Saving


def save_peft_adapter(adapter: LoraAdapter, path: str | Path) -> None:
    """Write ``adapter`` as a PEFT adapter directory that PEFT 0.17+ can load.

    Writes ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT key names, float32,
    contiguous) into a hidden temporary directory next to ``path``, then renames it into place.
    An existing adapter at ``path`` is replaced as a whole (it is renamed aside, the new one
    renamed in, then the old one deleted), so a failure before the swap leaves the old adapter
    untouched. ``path``'s parent is created if needed.

    Raises:
        AdapterError: ``path`` is a symlink, a file, or a non-empty directory that is not an
            adapter (it is never replaced).
        OSError: writing failed; the old adapter, if any, is still in place.
    """
    target = Path(path)
    if target.is_symlink():
        raise AdapterError(f"cannot save adapter to {target}: it is a symlink")
    if target.exists():
        if not target.is_dir():
            raise AdapterError(f"cannot save adapter to {target}: it exists and is not a directory")
        if not (target / CONFIG_NAME).is_file() and any(target.iterdir()):
            raise AdapterError(
                f"refusing to replace {target}: it is a non-empty directory without "
                f"{CONFIG_NAME}, so not an adapter"
            )
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
    try:
        _write_adapter_files(adapter, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _move_into_place(tmp, target)
    logger.info(
        "saved LoRA adapter to %s: rank %d, alpha %g, %d layers, targets %s",
        target,
        adapter.rank,
        adapter.alpha,
        adapter.num_layers,
        ",".join(adapter.target_modules),
    )


def _write_adapter_files(adapter: LoraAdapter, out_dir: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for (layer, target), (a, b) in sorted(adapter.weights.items()):
        prefix = f"base_model.model.model.layers.{layer}.{_PARENT[target]}.{target}"
        tensors[f"{prefix}.lora_A.weight"] = _standalone(a, seen_storage)
        tensors[f"{prefix}.lora_B.weight"] = _standalone(b, seen_storage)
    weights_path = out_dir / SAFETENSORS_NAME
    safetensors.torch.save_file(tensors, str(weights_path), metadata={"format": "pt"})
    _fsync_path(weights_path)

    alpha: float | int = int(adapter.alpha) if adapter.alpha.is_integer() else adapter.alpha
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": adapter.rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(adapter.target_modules),
        "bias": "none",
        "use_rslora": adapter.use_rslora,
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "base_model_name_or_path": adapter.base_model_name_or_path,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "lora_bias": False,
    }
    config_path = out_dir / CONFIG_NAME
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_path(out_dir)


def _standalone(t: torch.Tensor, seen_storage: set[int]) -> torch.Tensor:
    # safetensors refuses views and tensors that share storage (e.g. slices of one fused
    # buffer), so copy those; tensors that own their memory are written without a copy.
    t = t.detach().contiguous()
    storage = t.untyped_storage()
    if storage.data_ptr() in seen_storage or storage.nbytes() != t.numel() * t.element_size():
        t = t.clone()
    seen_storage.add(t.untyped_storage().data_ptr())
    return t


def _move_into_place(tmp: Path, target: Path) -> None:
    if not target.exists():
        try:
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_path(target.parent)
        return
    aside = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
    try:
        os.replace(target, aside)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, target)
    except BaseException:
        try:
            os.replace(aside, target)
        except OSError:
            logger.error("could not restore the previous adapter %s; it is at %s", target, aside)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_path(target.parent)
    shutil.rmtree(aside, ignore_errors=True)


def _fsync_path(p: Path) -> None:
    """fsync a file or directory so the data (or the rename) survives a crash."""
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
