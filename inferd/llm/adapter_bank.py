"""Which LoRA adapters the engine knows, which hold a slot, and the slot a request gets.

:class:`AdapterBank` is :class:`inferd.llm.engine.LLMEngine`'s (``engine.adapters``):
the replica's adapter commands (:mod:`inferd.serving.generation`) and the version's
registered adapters (:mod:`inferd.llm.loader`) go through it, and every request for an
adapter asks it for a slot. The weights themselves live in the model's
:class:`inferd.llm.lora.LoRABank`, which this fills and evicts.

An adapter is *known* (its folder: registered with the version, or loaded at run time)
and, while it holds one of the bank's slots, *loaded*. A request for a known adapter that
is not loaded loads it (:meth:`AdapterBank.ensure`), into a free slot or the slot of the
least recently used adapter that no running sequence uses; with every slot in use by
running sequences it waits for one (the caller holds it). A slot is recycled only once no
name and no live sequence uses it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from inferd.llm.metrics import GenerationMetrics

if TYPE_CHECKING:
    from inferd.llm.lora import LoRAAdapter, LoRABank


class AdapterBank:
    def __init__(
        self,
        lora: LoRABank | None,
        live_slots: Callable[[], set[int]],
        metrics: GenerationMetrics,
    ) -> None:
        """``lora``: the model's slots (None: a model without LoRA support, which takes
        no adapter). ``live_slots``: the slots the engine's live sequences use now."""
        self.lora = lora
        self._live_slots = live_slots
        self.metrics = metrics
        self._slots: OrderedDict[str, int] = OrderedDict()
        """Loaded adapters: name -> slot, least recently used first."""
        self._known: dict[str, Path] = {}
        """Adapters it may load: name -> folder."""
        self.loaded: tuple[str, ...] = ()
        """The loaded adapters' names, replaced whole (read from other threads)."""
        self.loads = 0
        """Adapters loaded because a request needed them."""
        self.room = lora.max_adapters if lora is not None else 0
        """Slots a request for another adapter could load it into now: free, or held by
        an adapter no sequence uses (counted after each step; read from other threads)."""
        self._slot_loads: dict[int, int] = {}
        """Adapters loaded into each slot so far: with the slot, the prefix-cache salt
        of what it computes (a reloaded adapter reuses nothing of the old one's)."""

    def slot(self, name: str | None) -> int:
        """The slot of a loaded adapter (-1 for the base model); KeyError if not loaded."""
        return -1 if name is None else self._slots[name]

    def salt(self, slot: int) -> bytes:
        """The prefix-cache salt of what a sequence on ``slot`` computes (-1: none)."""
        return b"" if slot < 0 else b"%d:%d" % (slot, self._slot_loads[slot])

    @property
    def known(self) -> list[str]:
        return sorted(self._known)

    def load(self, name: str, folder: Path) -> dict[str, int]:
        """Load (or reload) an adapter under ``name`` now, evicting the least recently
        used idle one if every slot is taken; with every slot in use by running
        sequences, the next request for it loads it (ValueError: not an adapter this
        engine can load). Returns the loaded adapters' slots.

        A reload takes a fresh slot: sequences already running with the old weights
        finish on the old slot, and nothing computed with the old weights is reused
        for new requests.
        """
        from inferd.llm.lora import LoRAAdapter

        if self.lora is None:
            raise ValueError("this model was started without LoRA support")
        adapter = LoRAAdapter.load(folder)
        self._known[name] = folder
        slot = self._free_slot()
        if slot is None:
            if name in self._slots:
                self._drop(name)  # running ones finish on the old weights
            return dict(self._slots)
        self._place(name, slot, adapter)
        return dict(self._slots)

    def know(self, name: str, folder: Path) -> None:
        """``name`` may be loaded from ``folder`` when a request needs it."""
        if self.lora is None:
            raise ValueError("this model was started without LoRA support")
        if not (folder / "adapter_config.json").is_file():
            raise FileNotFoundError(f"no adapter_config.json in {folder}")
        self._known[name] = folder

    def ensure(self, name: str | None) -> int | None:
        """The slot of adapter ``name`` (-1: the base model), loading it first if it is
        known but not loaded; None when every slot is in use by running sequences (try
        again after a step). KeyError: an adapter this engine does not know."""
        if name is None:
            return -1
        slot = self._slots.get(name)
        if slot is not None:
            self._slots.move_to_end(name)
            return slot
        folder = self._known[name]
        from inferd.llm.lora import LoRAAdapter

        slot = self._free_slot()
        if slot is None:
            return None
        began = time.perf_counter()
        self._place(name, slot, LoRAAdapter.load(folder))
        self.metrics.adapter_load_s.observe(time.perf_counter() - began)
        self.loads += 1
        return slot

    def unload(self, name: str) -> None:
        """New requests can no longer use it; running ones finish on its slot."""
        if name not in self._known:
            raise KeyError(name)
        del self._known[name]
        if name in self._slots:
            self._drop(name)

    def count_room(self) -> None:
        """:attr:`room`, after a step (on the engine's thread; nothing to count for a
        base model without adapters)."""
        if self.lora is not None and self._known:
            self.room = self.lora.max_adapters - len(self._live_slots() - {-1})

    def _free_slot(self) -> int | None:
        """A slot no adapter name and no live sequence holds, after evicting the least
        recently used adapter no live sequence uses, if need be."""
        assert self.lora is not None
        live = self._live_slots()
        busy = set(self._slots.values()) | live
        for slot in range(self.lora.max_adapters):
            if slot not in busy:
                return slot
        for name, slot in self._slots.items():  # least recently used first
            if slot not in live:
                self._drop(name)
                return slot
        return None

    def _place(self, name: str, slot: int, adapter: LoRAAdapter) -> None:
        assert self.lora is not None
        self.lora.load(slot, adapter)
        if name in self._slots:
            self._drop(name)
        self._slots[name] = slot
        self._slot_loads[slot] = self._slot_loads.get(slot, 0) + 1
        self.loaded = tuple(self._slots)

    def _drop(self, name: str) -> None:
        del self._slots[name]
        self.loaded = tuple(self._slots)
