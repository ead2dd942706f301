"""The engine's adapter bank alone: which adapter gets which slot, eviction, room, salts.

Pure unit tests: a stand-in for the model's LoRABank records what is loaded where, and
the live slots are a set the test sets, as the engine's live sequences would be.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from inferd.llm.adapter_bank import AdapterBank
from inferd.llm.lora import LoRAAdapter
from inferd.llm.metrics import GenerationMetrics


class Slots:
    """Stands in for :class:`inferd.llm.lora.LoRABank`: what the bank asks of it."""

    def __init__(self, max_adapters: int) -> None:
        self.max_adapters = max_adapters
        self.names: list[str | None] = [None] * max_adapters

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        self.names[slot] = adapter.name


def adapter(folder: Path) -> Path:
    """A PEFT-shaped rank-2 adapter of one c_attn (4 in, 12 out)."""
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2}))
    key = "base_model.model.transformer.h.0.attn.c_attn.lora_{}.weight"
    weights = {key.format("A"): torch.ones(2, 4), key.format("B"): torch.ones(12, 2)}
    save_file(weights, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, Path]:
    return {name: adapter(tmp_path / name) for name in ("a", "b", "c")}


def bank_of(slots: int, live: set[int]) -> tuple[AdapterBank, Slots]:
    lora = Slots(slots)
    return AdapterBank(lora, lambda: set(live), GenerationMetrics()), lora  # type: ignore[arg-type]


def test_requests_load_known_adapters_into_free_then_least_recently_used_slots(
    folders: dict[str, Path],
) -> None:
    live: set[int] = set()
    bank, lora = bank_of(2, live)
    for name, folder in folders.items():
        bank.know(name, folder)
    assert bank.ensure(None) == -1 and bank.slot(None) == -1
    assert (bank.ensure("a"), bank.ensure("b")) == (0, 1)
    assert bank.ensure("a") == 0  # now "b" is the least recently used
    assert bank.ensure("c") == 1 and lora.names == ["a", "c"]
    assert bank.loaded == ("a", "c") and bank.loads == 3
    assert bank.metrics.adapter_load_s.count == 3
    with pytest.raises(KeyError):
        bank.slot("b")
    with pytest.raises(KeyError):
        bank.ensure("unknown")


def test_a_slot_live_sequences_use_is_never_taken(folders: dict[str, Path]) -> None:
    live: set[int] = set()
    bank, _ = bank_of(2, live)
    for name, folder in folders.items():
        bank.know(name, folder)
    assert (bank.ensure("a"), bank.ensure("b")) == (0, 1)
    live |= {0, 1}
    assert bank.ensure("c") is None and bank.loaded == ("a", "b")
    bank.count_room()
    assert bank.room == 0
    live.discard(0)
    bank.count_room()
    assert bank.room == 1
    assert bank.ensure("c") == 0 and bank.loaded == ("b", "c")


def test_a_reload_takes_a_fresh_slot_and_salts_what_it_computes_apart(
    folders: dict[str, Path],
) -> None:
    live: set[int] = set()
    bank, _ = bank_of(2, live)
    assert bank.load("a", folders["a"]) == {"a": 0}
    salt = bank.salt(0)
    live.add(0)  # a sequence still runs on the old weights
    assert bank.load("a", folders["b"]) == {"a": 1}
    assert bank.salt(-1) == b"" and bank.salt(1) != salt
    live.clear()
    bank.unload("a")
    assert bank.loaded == () and bank.known == []
    assert bank.load("c", folders["c"]) == {"c": 0} and bank.salt(0) != salt
    with pytest.raises(KeyError):
        bank.unload("a")


def test_a_model_without_lora_takes_no_adapter(folders: dict[str, Path], tmp_path: Path) -> None:
    bank = AdapterBank(None, set, GenerationMetrics())
    assert bank.room == 0 and bank.ensure(None) == -1
    with pytest.raises(ValueError, match="without LoRA"):
        bank.load("a", folders["a"])
    with pytest.raises(ValueError, match="without LoRA"):
        bank.know("a", folders["a"])
    with_lora, _ = bank_of(1, set())
    with pytest.raises(FileNotFoundError):
        with_lora.know("a", tmp_path)
