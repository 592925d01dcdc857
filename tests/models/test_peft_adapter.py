"""Tests for coserve.models.peft_adapter against real PEFT on a tiny random Llama."""

from __future__ import annotations

import copy
import json
import math
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from coserve.models import peft_adapter as pa  # noqa: E402
from coserve.models.peft_adapter import (  # noqa: E402
    LORA_TARGETS,
    AdapterError,
    LoraAdapter,
    check_adapter_fits,
    load_peft_adapter,
    new_lora_adapter,
    save_peft_adapter,
)

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PARENT = {t: "self_attn" for t in ATTN} | {t: "mlp" for t in MLP}
NUM_LAYERS = 2


def tiny_model(seed: int = 0, hidden_size: int = 64, num_layers: int = NUM_LAYERS) -> Any:
    """A random ``LlamaForCausalLM`` small enough to build in milliseconds."""
    config = transformers.LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def linear(model: Any, layer: int, target: str) -> Any:
    """The (possibly PEFT-wrapped) linear ``target`` of decoder layer ``layer``."""
    return getattr(getattr(model.model.layers[layer], PARENT[target]), target)


def model_shapes(model: Any) -> dict[str, tuple[int, int]]:
    """target -> (out_features, in_features) of the model's linears."""
    shapes = {}
    for t in LORA_TARGETS:
        out_f, in_f = linear(model, 0, t).weight.shape
        shapes[t] = (int(out_f), int(in_f))
    return shapes


SHAPES = model_shapes(tiny_model())


def random_adapter(
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    use_rslora: bool = False,
    seed: int = 0,
    shapes: dict[str, tuple[int, int]] = SHAPES,
    num_layers: int = NUM_LAYERS,
) -> LoraAdapter:
    """An adapter with random A *and* B, so that it is not a no-op."""
    g = torch.Generator().manual_seed(seed)
    ordered = tuple(t for t in LORA_TARGETS if t in targets)
    weights = {}
    for layer in range(num_layers):
        for t in ordered:
            out_f, in_f = shapes[t]
            a = torch.randn(rank, in_f, generator=g) * 0.1
            b = torch.randn(out_f, rank, generator=g) * 0.1
            weights[(layer, t)] = (a, b)
    return LoraAdapter(
        rank=rank,
        alpha=alpha,
        target_modules=ordered,
        use_rslora=use_rslora,
        base_model_name_or_path="tiny-llama",
        num_layers=num_layers,
        weights=weights,
    )


def assert_same_adapter(x: LoraAdapter, y: LoraAdapter) -> None:
    assert (x.rank, x.alpha, x.target_modules, x.use_rslora, x.num_layers) == (
        y.rank,
        y.alpha,
        y.target_modules,
        y.use_rslora,
        y.num_layers,
    )
    assert x.base_model_name_or_path == y.base_model_name_or_path
    assert x.weights.keys() == y.weights.keys()
    for key, (a, b) in x.weights.items():
        assert torch.equal(a, y.weights[key][0]), key
        assert torch.equal(b, y.weights[key][1]), key


# --------------------------------------------------------------------------------------------
# Loading adapters written by PEFT


@pytest.mark.parametrize("targets", [ATTN, LORA_TARGETS, MLP], ids=["attn", "all", "mlp"])
@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("use_rslora", [False, True])
def test_load_adapter_saved_by_peft(
    tmp_path: Path, targets: tuple[str, ...], rank: int, use_rslora: bool
) -> None:
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=16,
        target_modules=list(targets),
        init_lora_weights=False,
        use_rslora=use_rslora,
    )
    peft_model = peft.get_peft_model(tiny_model(), config)
    peft_model.save_pretrained(tmp_path)

    adapter = load_peft_adapter(tmp_path)

    assert adapter.rank == rank
    assert adapter.alpha == 16.0
    assert adapter.use_rslora is use_rslora
    assert adapter.target_modules == targets
    assert adapter.num_layers == NUM_LAYERS
    expected_scaling = 16 / math.sqrt(rank) if use_rslora else 16 / rank
    assert adapter.scaling == pytest.approx(expected_scaling)
    assert adapter.scaling == pytest.approx(
        linear(peft_model.base_model.model, 0, targets[0]).scaling["default"]
    )
    assert set(adapter.weights) == {(i, t) for i in range(NUM_LAYERS) for t in targets}
    for (layer, t), (a, b) in adapter.weights.items():
        module = linear(peft_model.base_model.model, layer, t)
        assert a.dtype == torch.float32 and a.device.type == "cpu"
        assert torch.equal(a, module.lora_A["default"].weight.detach())
        assert torch.equal(b, module.lora_B["default"].weight.detach())


def _rewrite_tensors(
    directory: Path, fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
) -> None:
    path = directory / "adapter_model.safetensors"
    safetensors.torch.save_file(fn(safetensors.torch.load_file(path)), path)


def _edit_config(directory: Path, **updates: object) -> None:
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(updates)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "rename",
    [
        lambda k: k.removeprefix("base_model.model."),
        lambda k: k.replace(".weight", ".default.weight"),
        lambda k: k.removeprefix("base_model.model.").replace(".weight", ".default.weight"),
    ],
    ids=["no-prefix", "adapter-name", "both"],
)
def test_load_accepts_key_variants(tmp_path: Path, rename: Callable[[str], str]) -> None:
    adapter = random_adapter()
    save_peft_adapter(adapter, tmp_path / "a")
    _rewrite_tensors(tmp_path / "a", lambda sd: {rename(k): v for k, v in sd.items()})
    assert_same_adapter(load_peft_adapter(tmp_path / "a"), adapter)


def test_load_bin_fallback_and_dtype_conversion(tmp_path: Path) -> None:
    adapter = random_adapter()
    d = tmp_path / "a"
    save_peft_adapter(adapter, d)
    state = safetensors.torch.load_file(d / "adapter_model.safetensors")
    (d / "adapter_model.safetensors").unlink()
    torch.save({k: v.to(torch.bfloat16) for k, v in state.items()}, d / "adapter_model.bin")

    loaded = load_peft_adapter(d)

    for key, (a, b) in loaded.weights.items():
        assert a.dtype == torch.float32 and b.dtype == torch.float32
        ref_a, ref_b = adapter.weights[key]
        assert torch.equal(a, ref_a.to(torch.bfloat16).float())
        assert torch.equal(b, ref_b.to(torch.bfloat16).float())


@pytest.mark.parametrize(
    ("target_modules", "targets"),
    [
        (r".*\.(q_proj|v_proj)", ("q_proj", "v_proj")),
        (r"model\.layers\.\d+\.self_attn\.(q|v)_proj", ("q_proj", "v_proj")),
        ("all-linear", LORA_TARGETS),
        (["self_attn.q_proj", "v_proj"], ("q_proj", "v_proj")),
    ],
)
def test_load_resolves_target_selectors(
    tmp_path: Path, target_modules: str | list[str], targets: tuple[str, ...]
) -> None:
    adapter = random_adapter(targets=targets)
    save_peft_adapter(adapter, tmp_path / "a")
    _edit_config(tmp_path / "a", target_modules=target_modules)
    assert load_peft_adapter(tmp_path / "a").target_modules == targets


def test_load_honours_exclude_modules(tmp_path: Path) -> None:
    # PEFT semantics: an excluded module gets no LoRA even if target_modules selects it.
    adapter = random_adapter(targets=("q_proj",))
    save_peft_adapter(adapter, tmp_path / "a")
    _edit_config(tmp_path / "a", target_modules=["q_proj", "v_proj"], exclude_modules=["v_proj"])
    assert load_peft_adapter(tmp_path / "a").target_modules == ("q_proj",)


# --------------------------------------------------------------------------------------------
# Saving, and loading what we saved with PEFT


@pytest.mark.parametrize("use_rslora", [False, True])
def test_saved_adapter_loads_in_peft_and_matches_our_math(tmp_path: Path, use_rslora: bool) -> None:
    adapter = random_adapter(targets=LORA_TARGETS, rank=8, alpha=32, use_rslora=use_rslora)
    save_peft_adapter(adapter, tmp_path)

    base = tiny_model(seed=1)
    reference = copy.deepcopy(base)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model = peft.PeftModel.from_pretrained(base, str(tmp_path))
    problems = [str(w.message) for w in caught if "keys" in str(w.message).lower()]
    assert problems == []
    peft_model.eval()

    load_result = peft_model.load_adapter(str(tmp_path), adapter_name="second")
    assert load_result.unexpected_keys == []
    assert [k for k in load_result.missing_keys if ".lora_" in k] == []
    peft_model.set_adapter("default")

    for (layer, t), (a, b) in adapter.weights.items():
        module = linear(peft_model.base_model.model, layer, t)
        assert torch.equal(module.lora_A["default"].weight.detach(), a)
        assert torch.equal(module.lora_B["default"].weight.detach(), b)
        assert module.scaling["default"] == pytest.approx(adapter.scaling)
        inp = torch.randn(3, 5, a.shape[1])
        with torch.no_grad():
            got = module(inp)
            want = module.base_layer(inp) + (inp @ a.T @ b.T) * adapter.scaling
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # Full model: PEFT (unmerged and merged) vs the base with our delta folded into its weights.
    with torch.no_grad():
        for (layer, t), (a, b) in adapter.weights.items():
            linear(reference, layer, t).weight += adapter.scaling * (b @ a)
        ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(0))
        want_logits = reference(ids).logits
        with peft_model.disable_adapter():
            base_logits = peft_model(ids).logits
        assert not torch.allclose(base_logits, want_logits, atol=1e-3)  # the adapter matters
        torch.testing.assert_close(peft_model(ids).logits, want_logits, rtol=1e-4, atol=1e-4)
        merged = peft_model.merge_and_unload()
        torch.testing.assert_close(merged(ids).logits, want_logits, rtol=1e-4, atol=1e-4)


def test_save_writes_peft_format(tmp_path: Path) -> None:
    adapter = random_adapter(targets=("q_proj", "down_proj"), alpha=16)
    save_peft_adapter(adapter, tmp_path / "a")
    assert sorted(os.listdir(tmp_path / "a")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 8 and config["lora_alpha"] == 16
    assert config["target_modules"] == ["q_proj", "down_proj"]
    assert config["bias"] == "none" and config["modules_to_save"] is None
    assert config["use_dora"] is False and config["fan_in_fan_out"] is False
    assert config["base_model_name_or_path"] == "tiny-llama"
    state = safetensors.torch.load_file(tmp_path / "a" / "adapter_model.safetensors")
    assert set(state) == {
        f"base_model.model.model.layers.{i}.{p}.lora_{ab}.weight"
        for i in range(NUM_LAYERS)
        for p in ("self_attn.q_proj", "mlp.down_proj")
        for ab in "AB"
    }
    peft_config = peft.LoraConfig.from_pretrained(str(tmp_path / "a"))
    assert peft_config.r == 8 and set(peft_config.target_modules) == {"q_proj", "down_proj"}


@pytest.mark.parametrize("use_rslora", [False, True])
@pytest.mark.parametrize("alpha", [16.0, 12.5])
def test_round_trip_is_exact(tmp_path: Path, use_rslora: bool, alpha: float) -> None:
    adapter = random_adapter(targets=MLP, rank=4, alpha=alpha, use_rslora=use_rslora)
    save_peft_adapter(adapter, tmp_path / "a")
    assert_same_adapter(load_peft_adapter(tmp_path / "a"), adapter)


def test_save_tensors_that_share_storage(tmp_path: Path) -> None:
    # e.g. a trainer keeping all A matrices of a target in one fused buffer
    fused_a = torch.randn(NUM_LAYERS, 8, 64)
    fused_b = torch.randn(64, NUM_LAYERS * 8)
    weights = {
        (i, "q_proj"): (fused_a[i], fused_b[:, i * 8 : (i + 1) * 8]) for i in range(NUM_LAYERS)
    }
    adapter = LoraAdapter(
        rank=8,
        alpha=8.0,
        target_modules=("q_proj",),
        use_rslora=False,
        base_model_name_or_path=None,
        num_layers=NUM_LAYERS,
        weights=weights,
    )
    save_peft_adapter(adapter, tmp_path / "a")
    assert_same_adapter(load_peft_adapter(tmp_path / "a"), adapter)


# --------------------------------------------------------------------------------------------
# Atomic save


def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name != name)


def test_save_over_existing_adapter(tmp_path: Path) -> None:
    first, second = random_adapter(seed=1), random_adapter(seed=2, targets=LORA_TARGETS)
    save_peft_adapter(first, tmp_path / "a")
    (tmp_path / "a" / "README.md").write_text("written by PEFT")
    save_peft_adapter(second, tmp_path / "a")
    assert_same_adapter(load_peft_adapter(tmp_path / "a"), second)
    assert not (tmp_path / "a" / "README.md").exists()
    assert _leftovers(tmp_path, "a") == []


def test_failed_write_keeps_old_adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = random_adapter(seed=1)
    save_peft_adapter(first, tmp_path / "a")

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        save_peft_adapter(random_adapter(seed=2), tmp_path / "a")
    monkeypatch.undo()

    assert_same_adapter(load_peft_adapter(tmp_path / "a"), first)
    assert _leftovers(tmp_path, "a") == []


def test_failed_swap_restores_old_adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = random_adapter(seed=1)
    save_peft_adapter(first, tmp_path / "a")
    real_replace = os.replace

    def replace(src: str | Path, dst: str | Path) -> None:
        if ".tmp-" in Path(src).name:
            raise OSError("rename failed")
        real_replace(src, dst)

    monkeypatch.setattr(pa.os, "replace", replace)
    with pytest.raises(OSError, match="rename failed"):
        save_peft_adapter(random_adapter(seed=2), tmp_path / "a")
    monkeypatch.undo()

    assert_same_adapter(load_peft_adapter(tmp_path / "a"), first)
    assert _leftovers(tmp_path, "a") == []


def test_failed_first_save_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(RuntimeError):
        save_peft_adapter(random_adapter(), tmp_path / "a")
    assert list(tmp_path.iterdir()) == []


def test_save_creates_parents(tmp_path: Path) -> None:
    adapter = random_adapter()
    save_peft_adapter(adapter, tmp_path / "x" / "y" / "a")
    assert_same_adapter(load_peft_adapter(tmp_path / "x" / "y" / "a"), adapter)


def test_save_refuses_to_clobber_non_adapters(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(AdapterError, match="not a directory"):
        save_peft_adapter(random_adapter(), tmp_path / "file")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("x")
    with pytest.raises(AdapterError, match="not an adapter"):
        save_peft_adapter(random_adapter(), tmp_path / "data")
    assert (tmp_path / "data" / "precious.txt").read_text() == "x"
    (tmp_path / "empty").mkdir()
    save_peft_adapter(random_adapter(), tmp_path / "empty")  # an empty directory is fine
    load_peft_adapter(tmp_path / "empty")


# --------------------------------------------------------------------------------------------
# Malformed directories


def _drop(suffix: str) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    return lambda sd: {k: v for k, v in sd.items() if not k.endswith(suffix)}


def _add(
    key: str, tensor: torch.Tensor
) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    return lambda sd: {**sd, key: tensor}


def _replace(
    key: str, fn: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    return lambda sd: {k: fn(v) if k == key else v for k, v in sd.items()}


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def _tensors(
    fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
) -> Callable[[Path], None]:
    return lambda d: _rewrite_tensors(d, fn)


def _config(**updates: object) -> Callable[[Path], None]:
    return lambda d: _edit_config(d, **updates)


def _write(name: str, content: bytes) -> Callable[[Path], None]:
    def write(d: Path) -> None:
        (d / name).write_bytes(content)

    return write


def _keep_only_layer_1(d: Path) -> None:
    _rewrite_tensors(d, lambda sd: {k: v for k, v in sd.items() if ".layers.1." in k})
    _edit_config(d, target_modules=r"model\.layers\.1\..*(q_proj|v_proj)")


MALFORMED: dict[str, tuple[Callable[[Path], None], str]] = {
    "no-config": (lambda d: (d / "adapter_config.json").unlink(), "no adapter_config.json"),
    "no-weights": (lambda d: (d / "adapter_model.safetensors").unlink(), "no weights file"),
    "bad-json": (_write("adapter_config.json", b"{not json"), "not valid JSON"),
    "json-list": (_write("adapter_config.json", b"[1, 2]"), "JSON object"),
    "corrupt-weights": (_write("adapter_model.safetensors", b"garbage" * 10), "cannot read"),
    "not-lora": (_config(peft_type="IA3"), "only 'LORA'"),
    "dora": (_config(use_dora=True), "DoRA"),
    "bias": (_config(bias="all"), "bias='all' is not supported"),
    "modules-to-save": (_config(modules_to_save=["lm_head"]), "modules_to_save"),
    "layers-to-transform": (_config(layers_to_transform=[0, 1]), "not supported yet"),
    "layers-to-transform-int": (_config(layers_to_transform=0), "not supported yet"),
    "rank-pattern": (_config(rank_pattern={"q_proj": 4}), "not supported yet"),
    "alpha-pattern": (_config(alpha_pattern={"q_proj": 4}), "not supported yet"),
    "fan-in-fan-out": (_config(fan_in_fan_out=True), "fan_in_fan_out"),
    "lora-bias": (_config(lora_bias=True), "lora_bias"),
    "pissa": (_config(init_lora_weights="pissa_niter_4"), "rewrites the base weights"),
    "r-type": (_config(r="8"), "positive integer"),
    "alpha-type": (_config(lora_alpha="16"), "finite number"),
    "target-lm-head": (_config(target_modules=["q_proj", "v_proj", "lm_head"]), "'lm_head'"),
    "target-embed": (_config(target_modules=["q_proj", "v_proj", "embed_tokens"]), "embed_tokens"),
    "regex-lm-head": (_config(target_modules=r".*(q_proj|v_proj|lm_head)"), "lm_head"),
    "bad-regex": (_config(target_modules="(q_proj"), "not a valid regex"),
    "targets-type": (_config(target_modules=[1, 2]), "list of names"),
    "config-selects-more": (_config(target_modules=["q_proj", "k_proj", "v_proj"]), "lack"),
    "weights-have-more": (_config(target_modules=["q_proj"]), "does not select"),
    "rank-mismatch": (_config(r=4), "rank r=4"),
    "a-without-b": (_tensors(_drop("q_proj.lora_B.weight")), "no lora_B"),
    "b-without-a": (_tensors(_drop("layers.1.self_attn.v_proj.lora_A.weight")), "no lora_A"),
    "not-2d": (_tensors(_replace(f"{Q0}.lora_A.weight", lambda t: t[None])), "2-D"),
    "int-tensor": (_tensors(_replace(f"{Q0}.lora_A.weight", lambda t: t.long())), "floating"),
    "lm-head-weights": (
        _tensors(_add("base_model.model.lm_head.lora_A.weight", torch.zeros(8, 64))),
        "'lm_head'",
    ),
    "embed-weights": (
        _tensors(_add("base_model.model.model.embed_tokens.lora_embedding_A", torch.zeros(8, 100))),
        "embed_tokens",
    ),
    "dora-weights": (
        _tensors(_add(f"{Q0}.lora_magnitude_vector", torch.zeros(64))),
        "unexpected tensor",
    ),
    "unknown-key": (_tensors(_add("model.norm.weight", torch.zeros(64))), "unexpected tensor"),
    "wrong-parent": (
        _tensors(
            lambda sd: {k.replace("self_attn.q_proj", "mlp.q_proj"): v for k, v in sd.items()}
        ),
        "should be under self_attn",
    ),
    "duplicate": (
        _tensors(
            lambda sd: {
                **sd,
                f"{Q0.removeprefix('base_model.model.')}.lora_A.weight": sd[
                    f"{Q0}.lora_A.weight"
                ].clone(),
            }
        ),
        "duplicates",
    ),
    "two-adapter-names": (
        _tensors(
            lambda sd: {
                k.replace(".weight", ".x.weight") if "q_proj" in k else k: v for k, v in sd.items()
            }
        ),
        "several adapters",
    ),
    "shapes-differ-across-layers": (
        _tensors(
            _replace(
                "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight",
                lambda t: torch.zeros(8, 32),
            )
        ),
        "same shape",
    ),
    "empty-weights": (_tensors(lambda sd: {}), "no tensors"),
    "layer-subset": (_keep_only_layer_1, "only some layers"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_directory(tmp_path: Path, case: str) -> None:
    damage, message = MALFORMED[case]
    d = tmp_path / "adapter"
    save_peft_adapter(random_adapter(targets=("q_proj", "v_proj")), d)
    damage(d)
    with pytest.raises(AdapterError, match="adapter") as excinfo:
        load_peft_adapter(d)
    assert message in str(excinfo.value)
    assert str(d) in str(excinfo.value)


def test_missing_or_non_directory_path(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="does not exist") as excinfo:
        load_peft_adapter(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(excinfo.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(AdapterError, match="not a directory"):
        load_peft_adapter(tmp_path / "file")


# --------------------------------------------------------------------------------------------
# Fit to a model


def test_check_adapter_fits_accepts_matching_model() -> None:
    adapter = random_adapter(targets=LORA_TARGETS, rank=8)
    check_adapter_fits(adapter, num_layers=NUM_LAYERS, shapes=SHAPES, max_rank=8)
    check_adapter_fits(adapter, num_layers=NUM_LAYERS + 2, shapes=SHAPES, max_rank=64)


def test_check_adapter_fits_rank_too_big() -> None:
    with pytest.raises(AdapterError, match=r"/x/a.*rank 16 exceeds the maximum LoRA rank 8"):
        check_adapter_fits(
            random_adapter(rank=16), num_layers=NUM_LAYERS, shapes=SHAPES, max_rank=8, path="/x/a"
        )


def test_check_adapter_fits_other_hidden_size() -> None:
    other = model_shapes(tiny_model(hidden_size=96))
    adapter = random_adapter(shapes=other)
    with pytest.raises(AdapterError) as excinfo:
        check_adapter_fits(adapter, num_layers=NUM_LAYERS, shapes=SHAPES, max_rank=64, path="/x/a")
    message = str(excinfo.value)
    assert "/x/a" in message and "tiny-llama" in message
    assert "layer 0 q_proj lora_A has shape [8, 96], expected [8, 64]" in message
    assert "trained for another base model" in message


def test_check_adapter_fits_too_many_layers() -> None:
    adapter = random_adapter(num_layers=4)
    with pytest.raises(AdapterError, match="layer 3 but the model has only 2 layers"):
        check_adapter_fits(adapter, num_layers=NUM_LAYERS, shapes=SHAPES, max_rank=64)


def test_check_adapter_fits_unknown_target() -> None:
    shapes = {t: s for t, s in SHAPES.items() if t != "v_proj"}
    with pytest.raises(AdapterError, match="'v_proj'"):
        check_adapter_fits(random_adapter(), num_layers=NUM_LAYERS, shapes=shapes, max_rank=64)


def test_check_adapter_fits_loaded_from_other_model(tmp_path: Path) -> None:
    big = tiny_model(hidden_size=96)
    peft_model = peft.get_peft_model(big, peft.LoraConfig(r=8, target_modules=["q_proj"]))
    peft_model.save_pretrained(tmp_path)
    adapter = load_peft_adapter(tmp_path)
    with pytest.raises(AdapterError, match="trained for another base model"):
        check_adapter_fits(
            adapter, num_layers=NUM_LAYERS, shapes=SHAPES, max_rank=64, path=tmp_path
        )


# --------------------------------------------------------------------------------------------
# New adapters and invariants


def test_new_lora_adapter_matches_peft_init() -> None:
    adapter = new_lora_adapter(
        num_layers=NUM_LAYERS,
        shapes=SHAPES,
        rank=8,
        alpha=16,
        target_modules=["v_proj", "q_proj", "down_proj"],
        seed=3,
    )
    assert adapter.target_modules == ("q_proj", "v_proj", "down_proj")
    assert adapter.scaling == 2.0
    g = torch.Generator().manual_seed(3)
    for layer in range(NUM_LAYERS):
        for t in adapter.target_modules:
            a, b = adapter.weights[(layer, t)]
            expected = torch.empty(8, SHAPES[t][1])
            torch.nn.init.kaiming_uniform_(expected, a=math.sqrt(5), generator=g)
            assert torch.equal(a, expected)
            assert torch.equal(b, torch.zeros(SHAPES[t][0], 8))
            # kaiming_uniform_(a=sqrt(5)) is nn.Linear's U(-1/sqrt(in), 1/sqrt(in))
            assert a.abs().max() <= 1 / math.sqrt(SHAPES[t][1])

    same = new_lora_adapter(
        num_layers=NUM_LAYERS,
        shapes=SHAPES,
        rank=8,
        alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj"],
        seed=3,
    )
    assert_same_adapter(adapter, same)
    other = new_lora_adapter(
        num_layers=NUM_LAYERS,
        shapes=SHAPES,
        rank=8,
        alpha=16,
        target_modules=["q_proj", "v_proj", "down_proj"],
        seed=4,
    )
    assert not torch.equal(other.weights[(0, "q_proj")][0], adapter.weights[(0, "q_proj")][0])


def test_new_lora_adapter_is_a_noop_in_peft(tmp_path: Path) -> None:
    adapter = new_lora_adapter(
        num_layers=NUM_LAYERS, shapes=SHAPES, rank=4, alpha=8, target_modules=LORA_TARGETS
    )
    save_peft_adapter(adapter, tmp_path)
    base = tiny_model()
    ids = torch.randint(0, 100, (1, 6))
    with torch.no_grad():
        want = base(ids).logits
        got = peft.PeftModel.from_pretrained(base, str(tmp_path))(ids).logits
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target_modules": ["q_proj", "lm_head"]}, "unknown LoRA targets"),
        ({"target_modules": ["q_proj", "q_proj"]}, "duplicate"),
        ({"shapes": {"v_proj": (32, 64)}}, "no shape"),
        ({"rank": 0}, "rank"),
    ],
)
def test_new_lora_adapter_rejects_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "num_layers": NUM_LAYERS,
        "shapes": SHAPES,
        "rank": 8,
        "alpha": 16,
        "target_modules": ["q_proj"],
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        new_lora_adapter(**args)  # type: ignore[arg-type]


def test_lora_adapter_invariants() -> None:
    good = random_adapter()
    fields = {
        "rank": good.rank,
        "alpha": good.alpha,
        "target_modules": good.target_modules,
        "use_rslora": False,
        "base_model_name_or_path": None,
        "num_layers": good.num_layers,
        "weights": good.weights,
    }
    with pytest.raises(ValueError, match="LORA_TARGETS order"):
        LoraAdapter(**{**fields, "target_modules": ("v_proj", "q_proj")})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="missing"):
        LoraAdapter(**{**fields, "num_layers": 3})  # type: ignore[arg-type]
    half = {k: (a.half(), b) for k, (a, b) in good.weights.items()}
    with pytest.raises(ValueError, match="float32"):
        LoraAdapter(**{**fields, "weights": half})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank"):
        LoraAdapter(**{**fields, "rank": 4})  # type: ignore[arg-type]
