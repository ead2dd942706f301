"""Prompt-lookup speculative decoding (#37): the lookup, its settings, and the engine
giving exactly plain greedy decoding's tokens with it, on the fake model of
``test_llm_engine`` (which checks the paged cache at every forward) and on a tiny
random GPT-2 over the real attention paths (where a rejected guess's keys and values
must not leak into what follows)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inferd.llm.engine import EngineConfig, LLMEngine
from inferd.llm.speculation import Speculation
from inferd.shapes.llm import SamplingParams
from tests.conftest import build_tiny_gpt2, push_folder
from tests.test_llm_engine import EOS, VOCAB, CharTokenizer, Shape, engine, greedy, run_all, tokens

SPEC = Speculation(tokens=4, lookup_max=3, lookup_min=1)


def with_speculation(eng: LLMEngine, spec: Speculation | None = SPEC) -> LLMEngine:
    eng.config = dataclasses.replace(eng.config, speculation=spec)
    return eng


# -- the lookup ---------------------------------------------------------------------------


def test_the_longest_suffix_found_earlier_gives_what_followed_its_latest_occurrence():
    spec = Speculation(lookup_max=3, lookup_min=1)
    assert spec.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], 3) == [7, 8, 5]  # "2 3": the latest
    assert spec.propose([4, 1, 2, 3, 5, 6, 1, 2, 3], 3) == [5, 6, 1]  # "1 2 3"
    assert spec.propose([1, 2, 3, 4, 5, 6, 3], 3) == [4, 5, 6]  # only "3" occurs before
    assert spec.propose([1, 2, 3, 4, 5, 6, 3], 2) == [4, 5]  # as many as asked
    assert spec.propose([1, 2, 3, 4], 3) == []  # nothing recurs
    assert spec.propose([7, 7], 3) == [7, 7, 7]  # a run goes on
    assert spec.propose([5, 1, 2, 1, 2, 1], 3) == [2, 1, 2]  # and so does a loop
    assert spec.propose([9, 8, 1, 2, 3], 3) == []
    assert Speculation(lookup_min=2).propose([1, 2, 3, 4, 5, 6, 3], 3) == []
    assert Speculation(lookup_max=2).propose([4, 1, 2, 5, 9, 1, 2], 2) == [5, 9]


def test_settings_take_vllms_speculative_config_shape_and_refuse_what_they_cannot_do():
    parsed = Speculation.parse(
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2, "disable_by_batch_size": 8}, "llm.speculative",
    )  # fmt: skip
    assert parsed == Speculation(tokens=5, lookup_max=4, lookup_min=2, max_batch=8)
    assert Speculation.parse(None, "x") is None and Speculation.parse({}, "x") is None
    for bad, words in [
        ({"method": "eagle"}, "'eagle'"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_max": "4"}, "prompt_lookup_max"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
        ({"draft_model": "x"}, "draft_model"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
    ]:
        with pytest.raises(ValueError, match=words):
            Speculation.parse(bad, "llm.speculative")


def test_a_speculative_setting_the_engine_cannot_do_is_refused_at_push(tmp_path):
    folder = build_tiny_gpt2(tmp_path / "src")
    for bad, words in [({"method": "eagle"}, "ngram"), ({"num_speculative_tokens": 0}, "from 1")]:
        with pytest.raises(ValueError, match=words):
            push_folder(tmp_path / "data", "tiny", folder, speculative=bad)


# -- the engine, fake model ---------------------------------------------------------------


def _both(prompts: dict[str, list[int]], params: dict[str, SamplingParams], **kw):
    """Each request's outputs without and with speculation, and the steps each took."""
    runs = []
    for spec in (None, SPEC):
        eng = with_speculation(engine(**kw), spec)
        for rid, ids in prompts.items():
            eng.add_request(rid, ids, params[rid])
        outs = run_all(eng)
        runs.append((outs, eng))
    return runs


def test_accepted_guesses_give_plain_decodings_tokens_in_fewer_steps():
    prompt = [*range(10, 30), *range(10, 14)]  # the answer (14, 15, ...) is in the prompt
    (plain, plain_eng), (fast, fast_eng) = _both({"a": prompt}, {"a": greedy(12)})
    assert tokens(fast["a"]) == tokens(plain["a"]) == list(range(14, 26))
    assert fast["a"][-1].finish_reason == "length" and fast["a"][-1].completion_tokens == 12
    assert fast_eng.steps < plain_eng.steps - 5  # up to 5 tokens a step
    stats = fast_eng.stats()
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0
    assert fast_eng.scheduler.allocator.used_count == 0


def test_rejected_guesses_and_mixed_batches_change_no_token():
    # the fake model counts up; these prompts make the lookup guess other tokens
    prompts = {
        "wrong": [5, 6, 7, 8, 1, 2, 3, 9, 9, 6],  # after "6 7" came 8 (right), then 1 (wrong)
        "sampled": [20, 21, 22, 20, 21],
        "logprobs": [30, 31, 32, 30, 31],
        "long": list(range(40, 70)),  # prefilled in chunks while the others decode
    }
    params = {
        "wrong": greedy(10),
        "sampled": SamplingParams(max_tokens=10, temperature=1.0, seed=3),
        "logprobs": greedy(10, logprobs=True),
        "long": greedy(10),
    }
    (plain, _), (fast, eng) = _both(prompts, params, max_batched_tokens=16)
    for rid in prompts:
        assert tokens(fast[rid]) == tokens(plain[rid]), rid
    assert [o.logprob for o in fast["logprobs"]] == [o.logprob for o in plain["logprobs"]]
    stats = eng.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]


def test_a_guess_that_ends_the_generation_ends_it_where_plain_decoding_does():
    # counting up wraps to EOS (0) after 127: the guess holds 127, EOS, 1, 2
    prompt = [125, 126, 127, 0, 1, 2, 3, 124, 125, 126]
    (plain, _), (fast, _) = _both({"a": prompt}, {"a": greedy(10)})
    assert tokens(fast["a"]) == tokens(plain["a"]) == [127, EOS]
    assert fast["a"][-1].finish_reason == "stop" and fast["a"][-1].completion_tokens == 2
    # max_tokens inside a guess, and a stop string inside one
    prompt = [*range(70, 90), *range(70, 74)]
    (plain, _), (fast, _) = _both({"a": prompt}, {"a": greedy(3)})
    assert tokens(fast["a"]) == tokens(plain["a"]) == [74, 75, 76]
    stop = SamplingParams(max_tokens=10, temperature=0, stop=(chr(77),))
    (plain, _), (fast, _) = _both({"a": prompt}, {"a": stop})
    assert [o.text for o in fast["a"]] == [o.text for o in plain["a"]]
    assert fast["a"][-1].finish_reason == "stop" == plain["a"][-1].finish_reason


def test_guesses_never_take_blocks_from_other_sequences():
    # 6 blocks of 4 tokens: two sequences that fit, with no room for a guess's tokens
    prompts = {"a": [*range(10, 18), *range(10, 12)], "b": [*range(40, 48), *range(40, 42)]}
    params = {"a": greedy(2), "b": greedy(2)}
    (plain, _), (fast, eng) = _both(prompts, params, num_blocks=6)
    for rid in prompts:
        assert tokens(fast[rid]) == tokens(plain[rid])
    assert eng.scheduler.preemptions == 0


class RandomWalk:
    """Writes a fixed pseudo-random token per position, whatever came before: a text
    whose repeats (single tokens recur often) never predict what follows."""

    config = Shape()

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.walk = torch.randint(10, 110, (Shape.n_positions + 1,), generator=gen)

    def forward(self, inp, cache, lora=None) -> torch.Tensor:
        logits = torch.full((len(inp.logits_indices), VOCAB), -10.0)
        wanted = self.walk[inp.positions[inp.logits_indices] + 1]
        logits[torch.arange(len(wanted)), wanted] = 10.0
        return logits


def test_a_text_that_never_repeats_its_context_gets_few_guesses():
    """Every guess misses: after each miss in a row a sequence waits longer (1, 2, 4 ...
    16 steps) before the next, so it checks few guessed tokens over 200."""
    runs = []
    for spec in (None, Speculation(tokens=4, lookup_max=3, lookup_min=1)):
        eng = with_speculation(engine(model=RandomWalk(), num_blocks=128), spec)
        eng.add_request("a", list(range(10, 30)), greedy(200))
        runs.append((tokens(run_all(eng)["a"]), eng.stats()))
    (plain, _), (fast, stats) = runs
    assert fast == plain and len(fast) == 200
    assert 0 < stats["spec_draft_tokens"] < 40  # one a step, without the pauses: ~180


def test_no_speculation_past_the_batch_size_it_is_disabled_by():
    prompt = [*range(10, 30), *range(10, 14)]
    eng = with_speculation(engine(), dataclasses.replace(SPEC, max_batch=1))
    eng.add_request("a", prompt, greedy(8))
    eng.add_request("b", prompt, greedy(8))
    run_all(eng)
    assert eng.stats()["spec_draft_tokens"] == 0


# -- the engine, a real GPT-2 ---------------------------------------------------------------


def _gpt2_engine(model, spec: Speculation | None) -> LLMEngine:
    config = EngineConfig(block_size=4, num_blocks=256, max_num_seqs=8, max_batched_tokens=64,
                          speculation=spec)  # fmt: skip
    return LLMEngine(model, CharTokenizer(), config)  # type: ignore[arg-type]


def test_a_real_model_gives_plain_greedy_tokens_and_hf_generates_them_too(gpt2_vocab128):
    hf, model = gpt2_vocab128
    gen = torch.Generator().manual_seed(0)
    prompts = {f"r{i}": torch.randint(1, 128, (12 + 5 * i,), generator=gen).tolist()
               for i in range(4)}  # fmt: skip
    prompts["copy"] = prompts["r0"] * 3  # a prompt that repeats itself: guesses hit
    outs = []
    for spec in (None, Speculation(tokens=5, lookup_max=4, lookup_min=1)):
        eng = _gpt2_engine(model, spec)
        for rid, ids in prompts.items():
            eng.add_request(rid, ids, greedy(40, ignore_eos=True))
        outs.append(run_all(eng))
    plain, fast = outs
    for rid in prompts:
        assert tokens(fast[rid]) == tokens(plain[rid]), rid
    assert eng.stats()["spec_accepted_tokens"] > 0
    ids = torch.tensor([prompts["copy"]])
    with torch.inference_mode():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                           min_new_tokens=40, do_sample=False, pad_token_id=EOS)  # fmt: skip
    assert tokens(fast["copy"]) == want[0, ids.shape[1] :].tolist()


def test_the_server_setting_is_checked_when_settings_are_read(monkeypatch):
    from inferd.config import Settings

    monkeypatch.setenv("INFERD_LLM__SPECULATIVE", '{"method": "ngram", "prompt_lookup_max": 9}')
    assert Settings().llm.speculative == {"method": "ngram", "prompt_lookup_max": 9}
    monkeypatch.setenv("INFERD_LLM__SPECULATIVE", '{"num_speculative_tokens": 0}')
    with pytest.raises(ValueError, match=r"llm\.speculative\.num_speculative_tokens"):
        Settings()
    monkeypatch.setenv("INFERD_LLM__SPECULATIVE", '{"method": "eagle", "model": "x"}')
    assert Settings().llm.speculative["method"] == "eagle"  # vLLM's to check
