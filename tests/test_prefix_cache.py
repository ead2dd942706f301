"""Prefix caching in inferd's engine (#37): blocks computed once are reused by later
prompts that start with the same tokens, and nothing changes in what is generated.

The fake model here reads each sequence's whole context back from the KV cache at
every position it predicts, so a block reused where it should not be (another prefix,
another adapter, a block overwritten since) changes the tokens and fails the test.
"""

from __future__ import annotations

import dataclasses

import torch

from inferd.llm.batch import KVCache, ModelInput
from inferd.llm.blocks import BlockAllocator, block_key
from inferd.llm.engine import EngineConfig, LLMEngine
from inferd.llm.scheduler import Scheduler, SchedulerConfig
from inferd.llm.sequence import Sequence
from inferd.llm.speculation import Speculation
from tests.test_llm_engine import VOCAB, CharTokenizer, Shape, greedy, run_all, tokens


class ContextModel:
    """The next token is a hash of every token before it, as the cache holds them."""

    config = Shape()

    def __init__(self) -> None:
        self.computed = 0

    def forward(self, inp: ModelInput, cache: KVCache, lora: object = None) -> torch.Tensor:
        flat = cache.tensor[0, 0, :, 0, 0]
        flat[inp.slot_mapping] = inp.input_ids.float()
        self.computed += len(inp.input_ids)
        picks: list[int] = []
        start = 0
        for ctx, n, table in zip(inp.context_lens, inp.new_lens, inp.block_tables, strict=True):
            seen = flat[cache.slots(table, 0, ctx + n)].long().tolist()
            for at in range(n):  # what follows each position of this chunk
                context = seen[: ctx + at + 1]
                picks.append(1 + (sum(t * (i + 7) for i, t in enumerate(context)) % (VOCAB - 1)))
            start += n
        chosen = torch.tensor(picks)[inp.logits_indices]
        logits = torch.full((len(chosen), VOCAB), -10.0)
        logits[torch.arange(len(chosen)), chosen] = 10.0
        return logits


def make(caching: bool = True, num_blocks: int = 64, spec: Speculation | None = None,
         max_batched_tokens: int = 32) -> tuple[LLMEngine, ContextModel]:  # fmt: skip
    model = ContextModel()
    config = EngineConfig(block_size=4, num_blocks=num_blocks, max_num_seqs=8,
                          max_batched_tokens=max_batched_tokens, prefix_caching=caching,
                          speculation=spec)  # fmt: skip
    return LLMEngine(model, CharTokenizer(), config), model  # type: ignore[arg-type]


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- the blocks -----------------------------------------------------------------------------


def test_freed_blocks_stay_reusable_and_prompt_ends_are_evicted_before_their_beginnings():
    pool = BlockAllocator(4)
    k0 = block_key(b"", [1, 2])
    k1 = block_key(k0, [3, 4])
    held = pool.allocate(2)
    assert held is not None
    pool.register(held[0], k0)
    pool.register(held[1], k1)
    pool.free(held)
    assert (pool.free_count, pool.cached_count, pool.references) == (4, 2, 0)
    assert pool.lookup([k0, k1, block_key(k1, [5, 6])]) == held  # the longest run known
    assert (pool.free_count, pool.holds(held[0]), pool.references) == (2, 1, 2)
    assert pool.lookup([k0]) == held[:1] and pool.holds(held[0]) == 2  # shared
    pool.free(held[:1])
    pool.free(held)
    assert pool.allocate(3) is not None  # the two never used, then the prompt's end
    assert pool.lookup([k0, k1]) == held[:1]  # its beginning is still there
    assert pool.allocate(2) is None  # 3 + 1 held: none left


def test_keys_chain_the_blocks_before_them_and_the_salt():
    k = block_key(b"", [1, 2, 3])
    assert block_key(b"", [1, 2, 3]) == k and len(k) == 16
    assert block_key(k, [4]) != block_key(block_key(b"", [9, 2, 3]), [4])
    assert block_key(b"", [1, 2, 3], b"0:1") not in (k, block_key(b"", [1, 2, 3], b"0:2"))


def test_sequences_with_another_salt_share_nothing():
    sched = Scheduler(SchedulerConfig(num_blocks=32, block_size=4))
    first = Sequence("a", list(range(1, 14)), greedy(1), cache_salt=b"0:1")
    sched.add(first)
    sched.update(sched.schedule(), {first: 99})  # 13 tokens computed, one sampled: done
    assert first.finished and sched.allocator.cached_count == 3
    for salt, hit in ((b"0:2", 0), (b"", 0), (b"0:1", 12)):
        seq = Sequence(f"s{salt!r}", list(range(1, 14)), greedy(1), cache_salt=salt)
        sched.add(seq)
        sched.schedule()
        assert seq.cached_tokens == hit, salt
        sched.finish(seq, "abort")


# -- the engine -------------------------------------------------------------------------------


def test_shared_prefixes_are_computed_once_and_give_the_same_tokens():
    system = ids(40, 1)
    prompts = {
        "a": [*system, 5],
        "b": [*system, 6, 7],
        "c": system[:21],  # a prefix of a prefix: up to its last full block but one token
        "d": ids(30, 2),  # nothing shared
    }
    cached, cached_model = make(True)
    plain, plain_model = make(False)
    for rid, prompt in prompts.items():  # one after the other: each can reuse the last
        for eng in (plain, cached):
            eng.add_request(rid, prompt, greedy(6))
        assert tokens(run_all(cached)[rid]) == tokens(run_all(plain)[rid]), rid
    stats = cached.stats()
    assert stats["prefix_cache_hits"] > 0 and plain.stats()["prefix_cache_hits"] == 0
    # b and c reuse a's 10 blocks of the system prompt (c: 5 of them), at least
    assert cached_model.computed < plain_model.computed - 40
    assert cached.scheduler.allocator.used_count == 0  # cached blocks are free blocks


def test_a_later_turn_reuses_the_earlier_turns_prompt_and_output():
    eng, model = make()
    first = ids(23, 3)
    eng.add_request("t1", first, greedy(9))
    reply = tokens(run_all(eng)["t1"])
    second = first + reply + [11, 12, 13]
    before = model.computed
    eng.add_request("t2", second, greedy(5))
    got = tokens(run_all(eng)["t2"])
    # 23 + 9 tokens = 32: the whole first turn but its last token's block part
    assert model.computed - before <= len(second) - 28 + 5
    fresh, _ = make(False)
    fresh.add_request("t2", second, greedy(5))
    assert got == tokens(run_all(fresh)["t2"])


def test_preemption_and_a_tiny_cache_change_no_token():
    system = ids(16, 4)
    prompts = {f"r{i}": system + ids(3 + i, 10 + i) for i in range(6)}
    results = []
    for caching, blocks in ((False, 256), (True, 18)):  # 18 blocks: preemptions
        eng, _ = make(caching, num_blocks=blocks)
        for rid, prompt in prompts.items():
            eng.add_request(rid, prompt, greedy(12, ignore_eos=True))
        results.append(({rid: tokens(o) for rid, o in run_all(eng).items()}, eng))
    (plain, _), (cached, eng) = results
    assert cached == plain
    assert eng.scheduler.preemptions > 0 and eng.stats()["prefix_cache_hits"] > 0
    assert eng.scheduler.allocator.references == 0


def test_speculation_over_cached_prefixes_changes_no_token():
    loop = ids(6, 5) * 5  # repeats itself: guesses are made and kept
    prompts = {"a": loop, "b": [*loop, 9], "c": [*loop[:17], 3, 4]}
    results = []
    for caching, spec in ((False, None), (True, Speculation(tokens=4, lookup_max=3, lookup_min=1))):
        eng, _ = make(caching, spec=spec)
        out = {}
        for rid, prompt in prompts.items():
            eng.add_request(rid, prompt, greedy(20, ignore_eos=True))
            out.update({r: tokens(o) for r, o in run_all(eng).items()})
        results.append((out, eng))
    (plain, _), (fast, eng) = results
    assert fast == plain
    assert eng.stats()["prefix_cache_hits"] > 0


def test_aborted_and_waiting_requests_hold_no_cached_block():
    eng, _ = make(num_blocks=16, max_batched_tokens=8)
    system = ids(20, 6)
    eng.add_request("a", system, greedy(3))
    run_all(eng)
    eng.add_request("b", [*system, 1], greedy(30, ignore_eos=True))
    eng.add_request("c", [*system, 2], greedy(30, ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.abort("b")
    eng.abort("c")
    assert eng.scheduler.allocator.references == 0 and not eng.has_work()
    assert eng.scheduler.allocator.used_count == 0


def test_a_real_model_continues_a_cached_prefix_exactly(gpt2_vocab128):
    """The attention of a first chunk that starts after cached blocks (CPU paths)."""
    _, model = gpt2_vocab128
    system = ids(45, 7)
    prompts = {"a": system + ids(4, 8), "b": system + ids(9, 9), "c": system[:33]}
    results = []
    for caching in (False, True):
        config = EngineConfig(block_size=4, num_blocks=256, max_num_seqs=8,
                              max_batched_tokens=24, prefix_caching=caching)  # fmt: skip
        eng = LLMEngine(model, CharTokenizer(), config)  # type: ignore[arg-type]
        out = {}
        for rid, prompt in prompts.items():
            eng.add_request(rid, prompt, greedy(16, ignore_eos=True))
            out.update({r: tokens(o) for r, o in run_all(eng).items()})
        eng.add_request("d", prompts["a"] + out["a"] + [3], greedy(8, ignore_eos=True))
        out.update({r: tokens(o) for r, o in run_all(eng).items()})
        results.append((out, eng))
    (plain, _), (cached, eng) = results
    assert cached == plain
    assert eng.stats()["prefix_cache_hits"] == 44 + 32 + 64  # b, c, d: all they could


def test_the_setting_turns_it_off():
    config = dataclasses.replace(EngineConfig(), prefix_caching=False)
    eng = LLMEngine(ContextModel(), CharTokenizer(), config)  # type: ignore[arg-type]
    assert eng.scheduler.config.prefix_caching is False
    eng.add_request("a", ids(9, 1), greedy(2))
    run_all(eng)
    eng.add_request("b", ids(9, 1), greedy(2))
    run_all(eng)
    assert eng.stats()["prefix_cache_hits"] == 0 and eng.scheduler.allocator.cached_count == 0
