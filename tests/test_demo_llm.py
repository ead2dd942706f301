"""The demo LLM builds offline into files Hugging Face loads: tokenizer, base, adapter.

The budgets here are a ninth and a sixth of the real build's, so the models barely speak: the
tests check the artifacts and that the adapter moves the base, not either's quality.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoTokenizer, GPT2LMHeadModel

from inferd.demo.corpus import ENDOFTEXT
from inferd.demo.llm import (
    ADAPTER_STEPS_PER_S,
    BASE_STEPS_PER_S,
    LLMDemo,
    build_tiny_gpt2,
    greedy,
    random_gpt2_small,
)

BASE_SECONDS, ADAPTER_SECONDS = 10, 6
GPT2_SMALL_PARAMETERS = 124_439_808


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> LLMDemo:
    messages: list[str] = []
    built = build_tiny_gpt2(
        tmp_path_factory.mktemp("llm"),
        messages.append,
        train_seconds=BASE_SECONDS,
        adapter_seconds=ADAPTER_SECONDS,
    )
    assert messages and messages[-1].startswith("llm: built")
    return built


def test_files(demo: LLMDemo) -> None:
    assert {p.name for p in demo.base.iterdir()} == {
        "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
        "special_tokens_map.json",
    }  # fmt: skip
    assert {p.name for p in demo.adapter.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    adapter_config = json.loads((demo.adapter / "adapter_config.json").read_text())
    assert adapter_config["r"] == 8 and adapter_config["target_modules"] == ["c_attn"]
    assert Path(adapter_config["base_model_name_or_path"]) == demo.base.resolve()
    assert demo.adapter_name == "reviews"


def test_tokenizer_round_trips(demo: LLMDemo) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo.base)
    config = json.loads((demo.base / "config.json").read_text())
    assert len(tokenizer) == config["vocab_size"] == 4096
    assert tokenizer.eos_token == tokenizer.bos_token == ENDOFTEXT
    assert tokenizer.eos_token_id == config["eos_token_id"] == 4095
    text = "The function returns a list of str.\n  Naïve café, 3 ≠ 4 ✓ 日本"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) < len(text.encode())  # merges were learned, not just bytes
    assert tokenizer.decode(ids) == text


# peft 0.21 reads a property transformers 5 deprecated (peft/peft_model.py).
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_adapter_changes_the_style(demo: LLMDemo) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo.base)
    base = GPT2LMHeadModel.from_pretrained(demo.base).eval()
    plain = greedy(base, tokenizer, "This product is")
    tuned = PeftModel.from_pretrained(base, demo.adapter).eval()
    styled = greedy(tuned, tokenizer, "This product is")
    assert plain.startswith("This product is") and styled.startswith("This product is")
    # Trained for seconds, both may still repeat one word greedily (the more so on a busy
    # machine, the budgets being seconds): the adapter must move the distribution itself.
    prompt = tokenizer("This product is", return_tensors="pt")
    with torch.no_grad():
        tuned_logits = tuned(**prompt).logits[0, -1]
        with tuned.disable_adapter():
            plain_logits = tuned(**prompt).logits[0, -1]
    assert (tuned_logits - plain_logits).abs().max().item() > 1e-3
    assert demo.metadata["samples"]["adapter"]["This product is"] == styled
    assert demo.metadata["samples"]["base"]["This product is"] == plain


def test_metadata(demo: LLMDemo) -> None:
    meta = demo.metadata
    assert meta["corpus_chars"] > 500_000 and meta["base_tokens"] > 100_000
    assert 0.1 < meta["base_review_share"] < 0.25
    for part in ("base", "adapter"):
        assert meta[f"{part}_steps"] > 0
        assert 0 < meta[f"{part}_final_loss"] < 10
    # planned from the budget, not the clock: the same budget means the same steps
    assert meta["base_planned_steps"] == int(BASE_SECONDS * BASE_STEPS_PER_S)
    assert meta["adapter_planned_steps"] == int(ADAPTER_SECONDS * ADAPTER_STEPS_PER_S)
    json.dumps(meta)


def test_the_context_is_1024_tokens_and_every_position_was_trained(demo: LLMDemo) -> None:
    config = json.loads((demo.base / "config.json").read_text())
    assert config["n_positions"] == 1024
    tokenizer = json.loads((demo.base / "tokenizer_config.json").read_text())
    assert tokenizer["model_max_length"] == 1024
    by_position = demo.metadata["base_loss_by_position"]
    assert list(by_position) == ["0-127", "128-511", "512-1023"]
    # an untrained position embedding shows as a loss near uniform guessing (ln 4096 =
    # 8.3); trained ones stay close to the first 128 positions' loss
    assert all(loss < by_position["0-127"] + 1.0 for loss in by_position.values())


def test_same_budget_same_weights(tmp_path: Path) -> None:
    builds = [
        build_tiny_gpt2(tmp_path / name, train_seconds=0.5, adapter_seconds=0.5)
        for name in ("a", "b")
    ]
    if any(b.metadata[f"{p}_stopped_early"] for b in builds for p in ("base", "adapter")):
        pytest.skip("the machine was too busy to finish the planned steps")
    for folder, name in (("base", "model"), ("adapter", "adapter_model")):
        first, second = (getattr(b, folder) / f"{name}.safetensors" for b in builds)
        assert first.read_bytes() == second.read_bytes()


def test_random_gpt2_small(tmp_path: Path) -> None:
    folder = random_gpt2_small(tmp_path)
    parameters = _parameters(folder / "model.safetensors")
    assert abs(parameters - GPT2_SMALL_PARAMETERS) <= 0.01 * GPT2_SMALL_PARAMETERS
    config = json.loads((folder / "config.json").read_text())
    assert (config["n_layer"], config["n_head"], config["n_embd"]) == (12, 12, 768)
    assert (config["vocab_size"], config["n_positions"]) == (50257, 1024)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 50257 and tokenizer.eos_token_id == 50256
    assert tokenizer.decode(tokenizer("Return the value.")["input_ids"]) == "Return the value."
    shutil.rmtree(folder)  # 500 MB; pytest keeps the last three runs' temporary folders


def _parameters(path: Path) -> int:
    """Parameters stored in a safetensors file, from its JSON header alone."""
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


def test_training_windows_reach_every_position_of_the_context() -> None:
    import torch

    from inferd.demo.llm import BATCH_SIZE, LONG_EVERY, LONG_SEQ, SEQ_LEN, _windows

    stream = torch.arange(50_000)
    seen = torch.zeros(1024, dtype=torch.bool)
    for step, (window, positions) in enumerate(_windows(stream, 400)):
        long = step % LONG_EVERY == LONG_EVERY - 1
        rows, length = (1, LONG_SEQ) if long else (BATCH_SIZE, SEQ_LEN)
        assert window.shape == (rows, length + 1) and positions.shape == (rows, length)
        assert (window[:, 1:] - window[:, :-1] == 1).all()  # contiguous text
        assert (positions[:, 1:] - positions[:, :-1] == 1).all()
        assert positions.min() >= 0 and positions.max() < 1024
        if not long:
            assert (positions[: BATCH_SIZE // 2, 0] == 0).all()  # half start the context
        seen[positions.flatten()] = True
    assert seen.all()  # every position embedding is trained
