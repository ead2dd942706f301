"""GPT-2 over the paged cache against HF transformers and PEFT, on a tiny random model.

Every engine result is checked against an independent reference: HF's logits and greedy
``generate`` for the base model, PEFT's output for adapters, and the same sequence run
alone for mixed batches (so batching never changes what a sequence sees).
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from transformers import GPT2Config as HFConfig  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402

from inferd.llm.batch import KVCache, ModelInput  # noqa: E402
from inferd.llm.lora import LoRAAdapter, LoRABank  # noqa: E402
from inferd.llm.model import GPT2  # noqa: E402

VOCAB, N_LAYER, N_HEAD, N_EMBD = 300, 2, 4, 64
# PEFT 0.21 reads a property that transformers 5 deprecated; nothing of ours to fix.
peft_warning = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)


@dataclass
class Seq:
    """A sequence as the engine tracks it: its tokens, blocks and how much is cached."""

    tokens: list[int]
    table: list[int]
    adapter: int = -1
    cached: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)


def step(model: GPT2, cache: KVCache, work: list[tuple[Seq, int]], bank=None) -> torch.Tensor:
    """One forward over ``n`` new tokens of each sequence; logits of each one's last token."""
    ids, pos, slots, idx = [], [], [], []
    for seq, n in work:
        start = seq.cached
        ids += seq.tokens[start : start + n]
        pos += range(start, start + n)
        slots += cache.slots(seq.table, start, start + n)
        idx.append(len(ids) - 1)
    inp = ModelInput(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(pos),
        slot_mapping=torch.tensor(slots),
        new_lens=[n for _, n in work],
        context_lens=[seq.cached for seq, _ in work],
        block_tables=[seq.table for seq, _ in work],
        logits_indices=torch.tensor(idx),
        adapter_slots=[seq.adapter for seq, _ in work],
    )
    logits = model(inp, cache, bank)
    for (seq, n), row in zip(work, logits, strict=True):
        seq.cached += n
        seq.logits.append(row)
    return logits


def new_cache(model: GPT2, num_blocks: int = 64, block_size: int = 4) -> KVCache:
    c = model.config
    return KVCache(c.n_layer, c.n_head, c.head_dim, num_blocks, block_size, model.dtype)


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(
        0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[GPT2LMHeadModel, Path]:
    torch.manual_seed(0)
    config = HFConfig(
        n_layer=N_LAYER,
        n_head=N_HEAD,
        n_embd=N_EMBD,
        vocab_size=VOCAB,
        n_positions=128,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    model = GPT2LMHeadModel(config).eval()
    folder = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


@pytest.fixture(scope="module")
def model(hf_model: tuple[GPT2LMHeadModel, Path]) -> GPT2:
    return GPT2.load(hf_model[1])


@pytest.fixture(scope="module")
def adapters(
    hf_model: tuple[GPT2LMHeadModel, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[torch.nn.Module, Path]]:
    """Two PEFT adapters with random (non-zero) B: c_attn rank 4, and c_attn+c_proj rank 8
    (both projections named c_proj, rsLoRA scaling)."""
    specs = {
        "one": {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn"]},
        "two": {
            "r": 8,
            "lora_alpha": 16,
            "target_modules": ["c_attn", "c_proj"],
            "use_rslora": True,
        },
    }
    out = {}
    for seed, (name, spec) in enumerate(specs.items()):
        torch.manual_seed(100 + seed)
        config = peft.LoraConfig(fan_in_fan_out=True, lora_dropout=0.0, **spec)
        wrapped = peft.get_peft_model(copy.deepcopy(hf_model[0]), config).eval()
        for pname, param in wrapped.named_parameters():
            if "lora_B" in pname:
                torch.nn.init.normal_(param, std=0.3)
        folder = tmp_path_factory.mktemp(f"lora-{name}")
        wrapped.save_pretrained(folder)
        out[name] = (wrapped, folder)
    return out


def reference(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def prefill_all(model: GPT2, tokens: list[int]) -> torch.Tensor:
    """The whole prompt in one prefill, logits at every position."""
    n = len(tokens)
    table = list(range(-(-n // 4)))
    cache = new_cache(model, num_blocks=len(table))
    inp = ModelInput(
        input_ids=torch.tensor(tokens),
        positions=torch.arange(n),
        slot_mapping=torch.tensor(cache.slots(table, 0, n)),
        new_lens=[n],
        context_lens=[0],
        block_tables=[table],
        logits_indices=torch.arange(n),
        adapter_slots=[-1],
    )
    return model(inp, cache)


def test_one_prefill_matches_hf(hf_model, model):
    tokens = prompt(1, 40)
    logits = prefill_all(model, tokens)
    assert logits.dtype == torch.float32
    assert logits.shape == (40, VOCAB)
    torch.testing.assert_close(logits, reference(hf_model[0], tokens), atol=1e-4, rtol=1e-4)


def test_packed_lm_head_is_used_and_agrees_with_f_linear(hf_model):
    """float32 on CPU packs the head for oneDNN; the logits equal the unpacked head's."""
    packed = GPT2.load(hf_model[1])
    assert packed._packed_head is not None  # oneDNN ships with the CPU torch wheel
    plain = GPT2.load(hf_model[1])
    plain._packed_head = None
    tokens = prompt(3, 24)
    torch.testing.assert_close(
        prefill_all(packed, tokens), prefill_all(plain, tokens), atol=1e-5, rtol=1e-5
    )
    assert GPT2.load(hf_model[1], dtype=torch.bfloat16)._packed_head is None


def test_chunked_paged_greedy_decode_matches_generate(hf_model, model):
    tokens = prompt(2, 11)
    table = list(range(16))
    random.Random(3).shuffle(table)
    seq = Seq(list(tokens), table)
    cache = new_cache(model, num_blocks=16, block_size=4)
    while seq.cached < len(tokens):
        step(model, cache, [(seq, min(3, len(tokens) - seq.cached))])
    for i in range(10):
        seq.tokens.append(int(seq.logits[-1].argmax()))
        if i < 9:
            step(model, cache, [(seq, 1)])
    ids = torch.tensor([tokens])
    expected = hf_model[0].generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, pad_token_id=0
    )
    assert seq.tokens == expected[0].tolist()


def mixed_batch(adapters: list[int]) -> tuple[list[Seq], list[int]]:
    """Four sequences and how many of their tokens are cached before the mixed step, in
    which the first continues its prefill, the second decodes, the third starts its
    prefill and the fourth decodes (so the decode rows are not contiguous)."""
    seqs = [
        Seq(prompt(10, 14), [5, 2, 9, 11], adapters[0]),
        Seq(prompt(11, 9), [0, 7, 3], adapters[1]),
        Seq(prompt(12, 7), [4, 8], adapters[2]),
        Seq(prompt(13, 5), [1, 6], adapters[3]),
    ]
    return seqs, [6, 9, 0, 5]


def run_mixed(model, bank, slots: list[int], together: bool) -> list[torch.Tensor]:
    """Logits of the mixed step, run as one batch or each sequence alone."""
    cache = new_cache(model, num_blocks=16)
    seqs, done = mixed_batch(slots)
    for seq, n in zip(seqs, done, strict=True):
        if n:
            step(model, cache, [(seq, n)], bank)
    seqs[1].tokens.append(7)
    seqs[3].tokens.append(42)
    work = [(seqs[0], 5), (seqs[1], 1), (seqs[2], 4), (seqs[3], 1)]
    if together:
        return list(step(model, cache, work, bank))
    return [step(model, cache, [w], bank)[0] for w in work]


def test_mixed_batch_equals_each_sequence_alone(hf_model, model):
    together = run_mixed(model, None, [-1] * 4, together=True)
    alone = run_mixed(model, None, [-1] * 4, together=False)
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    seqs, _ = mixed_batch([-1] * 4)
    full = [seqs[0].tokens[:11], [*seqs[1].tokens, 7], seqs[2].tokens[:4], [*seqs[3].tokens, 42]]
    for got, tokens in zip(together, full, strict=True):
        torch.testing.assert_close(got, reference(hf_model[0], tokens)[-1], atol=1e-4, rtol=1e-4)


def test_decode_batch_with_one_long_context(hf_model, model):
    """A long context beside short ones splits the decode batch into groups by length."""
    cache = new_cache(model, num_blocks=32)
    blocks = iter(range(32))
    seqs = []
    for i, n in enumerate([3, 60, 3, 4]):
        seqs.append(Seq(prompt(50 + i, n), [next(blocks) for _ in range(n // 4 + 1)]))
    for seq in seqs:
        step(model, cache, [(seq, len(seq.tokens))])
        seq.tokens.append(int(seq.logits[-1].argmax()))
    logits = step(model, cache, [(seq, 1) for seq in seqs])
    for got, seq in zip(logits, seqs, strict=True):
        torch.testing.assert_close(
            got, reference(hf_model[0], seq.tokens)[-1], atol=1e-4, rtol=1e-4
        )


def test_native_decode_kernel_equals_the_pytorch_path(model, monkeypatch):
    """The C paged-attention kernel (compiled here with the system's cc) and the
    gather + SDPA path give the same logits for a decode batch of scattered blocks,
    mixed context lengths and more sequences than threads."""
    import shutil

    from inferd.llm import attention, native

    if shutil.which("cc") is None:
        pytest.skip("no C compiler here: only the PyTorch path exists")
    assert native.kernel() is not None  # a compiler is here: the kernel must build

    def decode_logits() -> torch.Tensor:
        cache = new_cache(model, num_blocks=64)
        blocks = iter(torch.randperm(64, generator=torch.Generator().manual_seed(7)).tolist())
        seqs = []
        for i, n in enumerate([3, 17, 1, 40, 8, 9, 25]):
            seqs.append(Seq(prompt(70 + i, n), [next(blocks) for _ in range(n // 4 + 1)]))
        for seq in seqs:
            step(model, cache, [(seq, len(seq.tokens))])
            seq.tokens.append(int(seq.logits[-1].argmax()))
        return step(model, cache, [(seq, 1) for seq in seqs])

    with_kernel = decode_logits()
    monkeypatch.setattr(attention.native, "kernel", lambda: None)
    torch.testing.assert_close(with_kernel, decode_logits(), atol=1e-5, rtol=1e-5)


@peft_warning
def test_lora_matches_peft(model, adapters):
    bank = LoRABank(model.config, max_adapters=2, max_rank=8)
    bank.load(0, LoRAAdapter.load(adapters["one"][1]))
    bank.load(1, LoRAAdapter.load(adapters["two"][1]))
    tokens = prompt(20, 12)
    for slot, name in enumerate(("one", "two")):
        seq = Seq(tokens, [3, 1, 0], adapter=slot)
        cache = new_cache(model, num_blocks=4)
        step(model, cache, [(seq, 5)], bank)
        step(model, cache, [(seq, 7)], bank)
        expected = reference(adapters[name][0], tokens)
        torch.testing.assert_close(seq.logits[0], expected[4], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(seq.logits[1], expected[-1], atol=1e-4, rtol=1e-4)


@peft_warning
def test_lora_mixed_batch_equals_each_alone(hf_model, model, adapters):
    bank = LoRABank(model.config, max_adapters=3, max_rank=8)
    bank.load(2, LoRAAdapter.load(adapters["one"][1]))
    bank.load(0, LoRAAdapter.load(adapters["two"][1]))
    slots = [2, -1, 0, 2]  # adapter "one" on two non-adjacent sequences
    together = run_mixed(model, bank, slots, together=True)
    alone = run_mixed(model, bank, slots, together=False)
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    base = run_mixed(model, None, [-1] * 4, together=True)
    torch.testing.assert_close(together[1], base[1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(together[0], base[0], atol=1e-3)


@peft_warning
def test_lora_slot_reload_leaves_nothing_stale(model, adapters):
    one, two = (LoRAAdapter.load(adapters[n][1]) for n in ("one", "two"))
    bank = LoRABank(model.config, max_adapters=1, max_rank=8)
    tokens = prompt(30, 9)

    def assert_logits(expected: torch.Tensor) -> None:
        seq = Seq(tokens, [0, 1, 2], adapter=0 if bank.names[0] else -1)
        got = step(model, new_cache(model, num_blocks=3), [(seq, len(tokens))], bank)[0]
        torch.testing.assert_close(got, expected[-1], atol=1e-4, rtol=1e-4)

    bank.load(0, two)
    assert_logits(reference(adapters["two"][0], tokens))
    bank.unload(0)
    bank.load(0, one)  # "two" also touched c_proj and used rank 8: none of that may remain
    assert_logits(reference(adapters["one"][0], tokens))
    bank.load(0, two)
    bank.load(0, one)  # overwrite without unload
    assert_logits(reference(adapters["one"][0], tokens))
    bank.unload(0)
    with adapters["one"][0].disable_adapter():
        assert_logits(reference(adapters["one"][0], tokens))


def test_bfloat16_close_to_float32(hf_model, model):
    half = GPT2.load(hf_model[1], dtype=torch.bfloat16)
    assert half.wte.weight.dtype == torch.bfloat16
    got = run_mixed(half, None, [-1] * 4, together=True)
    want = run_mixed(model, None, [-1] * 4, together=True)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        assert torch.nn.functional.cosine_similarity(g, w, dim=0) > 0.999
        assert (g - w).abs().max() < 0.03 * w.abs().max()
    tokens = prompt(40, 60)
    agree = prefill_all(half, tokens).argmax(-1) == prefill_all(model, tokens).argmax(-1)
    assert agree.float().mean() >= 0.9


@peft_warning
def test_lora_refuses_what_it_cannot_serve(model, adapters, tmp_path):
    two = LoRAAdapter.load(adapters["two"][1])
    with pytest.raises(ValueError, match="max_rank"):
        LoRABank(model.config, max_adapters=1, max_rank=4).load(0, two)
    with pytest.raises(ValueError, match=r"no slots for attn\.c_proj"):
        LoRABank(model.config, 1, 8, targets=("attn.c_attn",)).load(0, two)
    bank = LoRABank(model.config, max_adapters=2, max_rank=8)
    with pytest.raises(ValueError, match="slot 1 is empty"):
        step(model, new_cache(model, num_blocks=2), [(Seq([1, 2], [0], adapter=1), 2)], bank)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (tmp_path / name).write_bytes((adapters["one"][1] / name).read_bytes())
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        LoRAAdapter.load(tmp_path)
