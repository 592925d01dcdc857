"""The Llama decoder family (Llama 2/3/3.1, Mistral, Qwen2) over one flat varlen batch.

The same modules serve the engine (paged KV cache, multi-LoRA rows) and the trainer (layer
recompute with autograd on the LoRA parameters): everything batch-specific arrives in a
:class:`ForwardContext`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from coserve.layers.activation import silu_and_mul
from coserve.layers.attention import AttentionBackend, AttentionMetadata, TorchAttention
from coserve.layers.lora import LoRAContext, LoRALinear
from coserve.layers.norm import AddNorm, RMSNorm
from coserve.layers.rotary import RopeTables, RotaryEmbedding
from coserve.models.config import ModelConfig

LayerHook = Callable[[int, torch.Tensor], None]


@dataclass
class ForwardContext:
    """Everything a forward pass needs besides token ids and positions.

    ``layer_hook(i, hidden)`` is called with the residual-stream input of decoder layer ``i`` and,
    with ``i == num_layers``, with the final hidden state before the last norm. It may read
    ``hidden``; it must not change it. It may raise to abandon the forward pass.
    """

    attn: AttentionMetadata
    kv_cache: torch.Tensor | None = None  # [N, L, 2, block_size, KVH, D]
    lora: LoRAContext | None = None
    backend: AttentionBackend | None = None
    layer_hook: LayerHook | None = None
    # ``mlp_hook(i, gate_up)``: layer ``i``'s gate/up projection output [T, 2·intermediate]
    mlp_hook: LayerHook | None = None
    # RoPE's cos/sin rows at this batch's positions, gathered once for every layer (the trainer's
    # recompute; ``rotary.tables(positions)``); None: each layer gathers its own
    rope: RopeTables | None = None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, num_slots: int, max_rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.sliding_window
        self.qkv_proj = LoRALinear(
            layer, cfg.hidden_size,
            {"q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size},
            cfg.attention_bias, num_slots, max_rank, dtype,
        )
        self.o_proj = LoRALinear(layer, cfg.q_size, {"o_proj": cfg.hidden_size}, False, num_slots, max_rank, dtype)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext
    ) -> torch.Tensor:
        q, k, v = self.project(x, positions, rotary, ctx.lora, ctx.rope)
        return self.o_proj(self.attend(q, k, v, ctx), ctx.lora)

    def project(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, lora: LoRAContext | None,
        rope: RopeTables | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token-wise: ``q [T, H, D], k, v [T, KVH, D]`` (RoPE applied) of ``x [T, d]``
        (``rope``: see :attr:`ForwardContext.rope`)."""
        qkv = self.qkv_proj(x, lora)
        return rotary.split_qkv(positions, qkv, (self.num_heads, self.num_kv_heads, self.head_dim), rope)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, *,
               out: torch.Tensor | None = None, kv_stored: bool = False) -> torch.Tensor:
        """The step's attention (writes the rows' KV unless ``kv_stored``; into ``out [T, H, D]``
        when given): ``[T, H·D]`` before ``o_proj``."""
        kv_layer = ctx.kv_cache[:, self.layer] if ctx.kv_cache is not None else None
        backend = ctx.backend or _DEFAULT_BACKEND
        return backend.forward(q, k, v, kv_layer, ctx.attn, self.scale, self.sliding_window, out=out,
                               kv_stored=kv_stored).reshape(-1, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, num_slots: int, max_rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = LoRALinear(
            layer, cfg.hidden_size,
            {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size},
            False, num_slots, max_rank, dtype,
        )
        self.down_proj = LoRALinear(
            layer, cfg.intermediate_size, {"down_proj": cfg.hidden_size}, False, num_slots, max_rank, dtype
        )

    def forward(self, x: torch.Tensor, lora: LoRAContext | None, hook: LayerHook | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)
        if hook is not None:
            hook(self.gate_up_proj.layer, gate_up)
        return self.down_proj(silu_and_mul(gate_up), lora)


class LayerOutput(NamedTuple):
    """A decoder layer's output with its last residual add left to the caller:
    ``h_{l+1} = hidden + delta``."""

    hidden: torch.Tensor  # h_l + attn(norm(h_l))
    delta: torch.Tensor  # mlp(norm(hidden))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))``. hidden: [T, d] -> [T, d]."""

    def __init__(self, cfg: ModelConfig, layer: int, num_slots: int, max_rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, layer, num_slots, max_rank, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, layer, num_slots, max_rank, dtype)

    def forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext
    ) -> torch.Tensor:
        out = self.forward_deferred(hidden, self.input_layernorm(hidden), positions, rotary, ctx)
        return out.hidden + out.delta

    def attention_half(
        self, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, ctx: ForwardContext
    ) -> torch.Tensor:
        """``h = hidden + attn(input_layernorm(hidden))``: the layer's first residual block (the
        trainer recomputes and differentiates each half on its own)."""
        return hidden + self.self_attn(self.input_layernorm(hidden), positions, rotary, ctx)

    def mlp_half(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``hidden + mlp(post_attention_layernorm(hidden))``: the layer's second residual block."""
        return hidden + self.mlp(self.post_attention_layernorm(hidden), ctx.lora, ctx.mlp_hook)

    def forward_deferred(
        self, hidden: torch.Tensor, normed: torch.Tensor, positions: torch.Tensor,
        rotary: RotaryEmbedding, ctx: ForwardContext,
    ) -> LayerOutput:
        """The block without its last residual add, so that the caller can fuse that add with
        the next norm. ``normed`` must be ``input_layernorm(hidden)``.

        hidden, normed: [T, d] -> hidden + attn [T, d], mlp delta [T, d].
        """
        q, k, v = self.self_attn.project(normed, positions, rotary, ctx.lora, ctx.rope)
        return self.finish(self.self_attn.attend(q, k, v, ctx), hidden, ctx.lora, ctx.mlp_hook)

    def finish(self, o: torch.Tensor, hidden: torch.Tensor, lora: LoRAContext | None,
               mlp_hook: LayerHook | None = None) -> LayerOutput:
        """Token-wise, after the attention ``o [T, H·D]``: ``o_proj``, the residual add and norm,
        the MLP (``hidden``: the layer's input)."""
        attn = self.self_attn.o_proj(o, lora)
        hidden, normed = self.post_attention_layernorm.add_and_norm(attn, hidden)
        return LayerOutput(hidden, self.mlp(normed, lora, mlp_hook))


class DecoderModel(nn.Module):
    """Embeddings, decoder layers, final norm."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, num_slots, max_rank, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 causal LM.

    ``forward(input_ids [T], positions [T], ctx) -> hidden [T, d]`` (after the final norm);
    ``compute_logits(hidden [n, d]) -> [n, V]`` in fp32.
    """

    def __init__(self, cfg: ModelConfig, *, num_lora_slots: int = 0, max_lora_rank: int = 16,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = cfg
        self.num_lora_slots = num_lora_slots
        self.max_lora_rank = max_lora_rank
        self.model = DecoderModel(cfg, num_lora_slots, max_lora_rank, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.lm_head: nn.Linear | None = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
            self.lm_head.weight.requires_grad_(False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """``[V, d]``: the embedding matrix when tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.embed(input_ids)
        hook = ctx.layer_hook
        delta: torch.Tensor | None = None
        for i, layer in enumerate(self.model.layers):
            assert isinstance(layer, DecoderLayer)
            hidden, normed = add_and_norm(layer.input_layernorm, hidden, delta)
            if hook is not None:
                hook(i, hidden)
            hidden, delta = layer.forward_deferred(hidden, normed, positions, self.rotary, ctx)
        hidden, normed = add_and_norm(self.model.norm, hidden, delta)
        if hook is not None:
            hook(len(self.model.layers), hidden)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.lm_head_weight.T).float()

    def lora_linears(self) -> list[LoRALinear]:
        return [m for m in self.modules() if isinstance(m, LoRALinear)]

    def lora_stacks(self, layer: int, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The adapter-slot stacks ``(A [S, r, in], B [S, out, r])`` of one LoRA target."""
        block = self.model.layers[layer]
        assert isinstance(block, DecoderLayer)
        lin = _TARGET_MODULE[target](block)
        return lin.lora_stacks(target)


def add_and_norm(norm: RMSNorm, hidden: torch.Tensor, delta: torch.Tensor | None) -> AddNorm:
    """The previous layer's last residual add ``h = hidden + delta`` (none for the embeddings)
    and ``norm(h)``, in one kernel where the fused kernels apply."""
    if delta is None:
        return AddNorm(hidden, norm(hidden))
    return norm.add_and_norm(delta, hidden)


_DEFAULT_BACKEND = TorchAttention()

_TARGET_MODULE: dict[str, Callable[[DecoderLayer], LoRALinear]] = {
    "q_proj": lambda b: b.self_attn.qkv_proj,
    "k_proj": lambda b: b.self_attn.qkv_proj,
    "v_proj": lambda b: b.self_attn.qkv_proj,
    "o_proj": lambda b: b.self_attn.o_proj,
    "gate_proj": lambda b: b.mlp.gate_up_proj,
    "up_proj": lambda b: b.mlp.gate_up_proj,
    "down_proj": lambda b: b.mlp.down_proj,
}

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
