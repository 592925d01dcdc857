"""Adapter slots of the multi-LoRA model: loading PEFT adapters, LRU reuse, training slots."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import torch

from coserve.layers.lora import LoRALinear
from coserve.models.llama import LlamaForCausalLM
from coserve.models.peft_adapter import LoraAdapter, check_adapter_fits, load_peft_adapter

logger = logging.getLogger(__name__)


class LoRAManager:
    """Owns the model's adapter slots: ``[0, max_loras)`` serve inference adapters,
    ``[max_loras, max_loras + num_training_slots)`` are reserved for training.

    Adapters are read and validated from disk when a request names them (:meth:`register`), so
    a bad adapter is a request error, never an engine failure; they are copied into a slot only
    when a sequence using them is admitted (:meth:`acquire`). A slot whose adapter no running
    sequence uses is reused least-recently-used first. Slot tensors are written in place only.
    """

    def __init__(self, model: LlamaForCausalLM, max_loras: int, num_training_slots: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.num_training_slots = num_training_slots
        self.max_rank = model.max_lora_rank
        device = model.lm_head_weight.device
        self.scales = torch.zeros(max_loras + num_training_slots, dtype=torch.float32, device=device)
        self._adapters: dict[str, tuple[str, LoraAdapter]] = {}  # name -> (path, adapter)
        self._slot_of: dict[str, int] = {}
        self._refs = [0] * max_loras
        self._lru: OrderedDict[int, str] = OrderedDict()  # loaded inference slots, oldest first
        self._linears = {
            (lin.layer, target): lin for lin in model.lora_linears() for target in lin.out_slices
        }
        # slot -> the (layer, target) pairs its adapter has (written or declared); a slot missing
        # here holds weights nobody declared
        self._targets: dict[int, frozenset[tuple[int, str]]] = {}
        self._unions: dict[frozenset[int], frozenset[tuple[int, str]] | None] = {}  # live_targets
        self._bound: dict[str, int] = {}  # name -> the training slot requests under that name read

    def bind_training_slot(self, name: str, i: int = 0) -> None:
        """Serve training slot ``i`` under ``name``: a request naming it runs with whatever adapter
        the trainer last wrote there (each optimizer step lands in place; a step may read a commit
        that is landing, layer by layer). No file is read; the slot is never evicted."""
        slot = self.training_slot(i)
        if name in self._adapters or name in self._bound:
            raise ValueError(f"adapter name {name!r} is already in use")
        self._bound[name] = slot

    def unbind_training_slot(self, name: str) -> None:
        """Stop serving a training slot under ``name`` (:meth:`bind_training_slot`); KeyError if it
        is not bound. A sequence admitted under it keeps reading the slot until it finishes."""
        del self._bound[name]

    def register(self, name: str, path: str | Path, adapter: LoraAdapter | None = None) -> None:
        """Read and validate the adapter at ``path`` under ``name`` (or take ``adapter``, read
        from there by :meth:`load` elsewhere); raises AdapterError/ValueError. (A name bound to a
        training slot, :meth:`bind_training_slot`, needs nothing read.)"""
        if name in self._bound:
            return
        if self.max_loras == 0:
            raise ValueError("this engine was started with max_loras=0: it serves no adapters")
        known = self._adapters.get(name)
        if known is not None:
            if known[0] != str(path):
                raise ValueError(f"adapter name {name!r} is already bound to {known[0]}, not {path}")
            return
        self._adapters[name] = (str(path), adapter if adapter is not None else self.load(path))

    def is_training(self, name: str) -> bool:
        """Is ``name`` bound to a training slot (its weights change as it trains)?"""
        return name in self._bound

    def path_of(self, name: str) -> str:
        """Where the adapter registered as ``name`` was read from (KeyError if none is)."""
        return self._adapters[name][0]

    def load(self, path: str | Path) -> LoraAdapter:
        """The adapter at ``path``, checked against this model (touches no slot: any thread may
        call it)."""
        adapter = load_peft_adapter(path)
        cfg = self.model.config
        check_adapter_fits(
            adapter, num_layers=cfg.num_layers, shapes=cfg.linear_shapes(), max_rank=self.max_rank, path=path
        )
        return adapter

    def unregister(self, name: str) -> None:
        """Forget the adapter registered as ``name`` (its slot, if loaded, becomes free); the
        caller makes sure no sequence uses it (:meth:`LLMEngine.remove_lora`). KeyError if unknown."""
        if name in self._bound:
            raise ValueError(f"{name!r} is the adapter being trained: it cannot be unloaded")
        del self._adapters[name]
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            assert self._refs[slot] == 0, "unregistering an adapter that a sequence still uses"
            del self._lru[slot]

    def acquire(self, name: str) -> int | None:
        """Bind ``name`` to a slot (loading it if needed) and take a reference; None if no slot is free."""
        if name in self._bound:
            return self._bound[name]
        slot = self._slot_of.get(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self.write(slot, self._adapters[name][1])
            self._slot_of[name] = slot
            self._lru[slot] = name
        self._refs[slot] += 1
        self._lru.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        if 0 <= slot < self.max_loras:
            self._refs[slot] -= 1
            assert self._refs[slot] >= 0, "adapter slot released more often than acquired"

    def _free_slot(self) -> int | None:
        used = set(self._lru)
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        for slot, name in self._lru.items():  # oldest first
            if self._refs[slot] == 0:
                del self._lru[slot]
                del self._slot_of[name]
                return slot
        return None

    def training_slot(self, i: int = 0) -> int:
        if not 0 <= i < self.num_training_slots:
            raise ValueError(f"training slot {i} does not exist (num_training_slots={self.num_training_slots})")
        return self.max_loras + i

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy ``adapter`` into ``slot`` in place (targets it lacks become zero)."""
        with torch.no_grad():
            for (layer, target), lin in self._linears.items():
                a, b = lin.lora_stacks(target)
                a[slot].zero_()
                b[slot].zero_()
                w = adapter.weights.get((layer, target))
                if w is not None:
                    a[slot, : adapter.rank].copy_(w[0])
                    b[slot, :, : adapter.rank].copy_(w[1])
            self.scales[slot] = adapter.scaling
        self.declare(slot, adapter.weights)

    def declare(self, slot: int, targets: Iterable[tuple[int, str]]) -> None:
        """Record the ``(layer, target)`` pairs of the adapter someone else writes into ``slot``
        (the trainer, into its training slot); the other pairs of that slot stay zero."""
        self._targets[slot] = frozenset(targets)
        self._unions.clear()

    def live_targets(self, slots: Iterable[int]) -> frozenset[tuple[int, str]] | None:
        """The ``(layer, target)`` pairs that the adapters in ``slots`` have, None if a slot's
        adapter was never written or declared (then every pair counts). Kept per set of slots
        until a slot changes: every eager step with adapters asks."""
        key = frozenset(slots)
        if key not in self._unions:
            known = [self._targets[slot] for slot in key if slot in self._targets]
            self._unions[key] = frozenset().union(*known) if len(known) == len(key) else None
        return self._unions[key]

    def stacks(self, layer: int, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(A [S, r, in], B [S, out, r])`` stacks of one linear (what the trainer updates)."""
        return self._linears[(layer, target)].lora_stacks(target)

    def linear(self, layer: int, target: str) -> LoRALinear:
        return self._linears[(layer, target)]
