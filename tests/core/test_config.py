"""The fine-tuning settings refuse values that would spoil a run: non-finite numbers (``inf``
passes a plain ``> 0`` test and turned every adapter weight non-finite) and a LoRA rank that no
targeted layer can use (the engine allocates every adapter slot at it)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from coserve.core.config import LoRAConfig, OptimConfig
from coserve.models.config import ModelConfig
from coserve.models.presets import preset_path

NON_FINITE = [math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("value", NON_FINITE)
@pytest.mark.parametrize(("field", "flag"), [("lr", "--lr"), ("weight_decay", "--weight-decay"),
                                             ("max_grad_norm", "--max-grad-norm"), ("eps", "eps")])
def test_optim_settings_must_be_finite(field: str, flag: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"{flag} must be .*finite.*got {value}"):
        OptimConfig(**{field: value})


@pytest.mark.parametrize(("kwargs", "flag"), [({"alpha": math.inf}, "--lora-alpha"), ({"alpha": math.nan}, "--lora-alpha"),
                                              ({"dropout": math.nan}, "--lora-dropout")])
def test_lora_settings_must_be_finite(kwargs: dict[str, Any], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        LoRAConfig(**kwargs)


def test_finite_settings_are_still_taken() -> None:
    assert OptimConfig(lr=1e3, weight_decay=0.0, max_grad_norm=0.0, eps=0.0).lr == 1e3
    assert LoRAConfig(alpha=1e6, dropout=0.5).alpha == 1e6


def test_a_rank_no_targeted_layer_can_use_is_refused() -> None:
    """The tiny preset: hidden 128, 4 query and 2 key/value heads of 32, MLP 344. q_proj and
    o_proj are 128 x 128, k_proj and v_proj 64 x 128: rank 128 is the most the attention targets
    can use, 64 the most k_proj and v_proj alone can."""
    shapes = ModelConfig.from_dir(preset_path("tiny")).linear_shapes()
    LoRAConfig(rank=128).check_rank(shapes)
    with pytest.raises(ValueError, match=r"--lora-rank 129 is above 128, .*q_proj 128, k_proj 64.*"
                                         r"give --lora-rank 128 or less"):
        LoRAConfig(rank=129).check_rank(shapes)
    LoRAConfig(rank=64, target_modules=("k_proj", "v_proj")).check_rank(shapes)
    with pytest.raises(ValueError, match="--lora-rank 65 is above 64"):
        LoRAConfig(rank=65, target_modules=("k_proj", "v_proj")).check_rank(shapes)
    with pytest.raises(ValueError, match="--lora-rank 100000 is above 128"):
        LoRAConfig(rank=100_000, target_modules=("down_proj",)).check_rank(shapes)
