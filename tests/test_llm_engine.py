"""Engine and scheduler with a transparent fake model: paging, chunking, preemption.

The fake model predicts ``token + 1`` and, on every forward, checks that the KV cache
holds each sequence's earlier tokens at the slots its block table names -- so paging
mistakes fail loudly here without a real network.
"""

from __future__ import annotations

import time

import pytest
import torch

from inferd.llm.batch import KVCache, ModelInput
from inferd.llm.engine import EngineConfig, EngineFull, LLMEngine
from inferd.llm.stops import StopChecker
from inferd.shapes.llm import SamplingParams

VOCAB = 128
EOS = 0


class CharTokenizer:
    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(
            "<eos>" if i == EOS else chr(i) for i in ids if i != EOS or not skip_special_tokens
        )


class Shape:
    n_layer, n_head, head_dim, n_positions = 1, 1, 1, 256


class PlusOneModel:
    config = Shape()

    def __init__(self, random_logits: bool = False) -> None:
        self.calls: list[ModelInput] = []
        self.random_logits = random_logits

    def forward(self, inp: ModelInput, cache: KVCache, lora: object = None) -> torch.Tensor:
        self.calls.append(inp)
        flat = cache.tensor[0, 0, :, 0, 0]
        flat[inp.slot_mapping] = inp.input_ids.float()
        start = 0
        for ctx, n, table in zip(inp.context_lens, inp.new_lens, inp.block_tables, strict=True):
            slots = cache.slots(table, 0, ctx + n)
            expected = inp.input_ids[start : start + n].float()
            assert torch.equal(flat[slots[ctx:]], expected)
            start += n
        last = inp.input_ids[inp.logits_indices]
        if self.random_logits:  # a pseudo-random row per last token, whatever the batch
            rows = [
                torch.randn(VOCAB, generator=torch.Generator().manual_seed(int(t))) for t in last
            ]
            return torch.stack(rows)
        logits = torch.full((len(last), VOCAB), -10.0)
        logits[torch.arange(len(last)), (last + 1) % VOCAB] = 10.0
        return logits


def engine(
    num_blocks: int = 64,
    block_size: int = 4,
    max_batched_tokens: int = 32,
    max_num_seqs: int = 16,
    max_waiting: int = 64,
    model: PlusOneModel | None = None,
    queue_timeout_s: float | None = None,
) -> LLMEngine:
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_batched_tokens=max_batched_tokens,
        max_waiting=max_waiting,
        queue_timeout_s=queue_timeout_s,
    )
    return LLMEngine(model or PlusOneModel(), CharTokenizer(), config)  # type: ignore[arg-type]


def run_all(eng: LLMEngine, max_steps: int = 10_000) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not eng.has_work():
            break
        for out in eng.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert not eng.has_work()
    return outputs


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, **kw)


def tokens(outs: list) -> list[int]:
    return [o.token_id for o in outs]


def test_single_request_generates_and_finishes_by_length():
    eng = engine()
    eng.add_request("a", [5, 6, 7], greedy(4))
    (outs,) = run_all(eng).values()
    assert tokens(outs) == [8, 9, 10, 11]
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert outs[-1].prompt_tokens == 3 and outs[-1].completion_tokens == 4
    assert eng.scheduler.allocator.used_count == 0


def test_mixed_lengths_chunked_prefill_and_late_joiners():
    model = PlusOneModel()
    eng = engine(max_batched_tokens=8, model=model)
    eng.add_request("long", list(range(1, 30)), greedy(5))
    eng.add_request("short", [40], greedy(6))
    eng.step()
    eng.add_request("late", [60, 61], greedy(3))
    outputs = run_all(eng)
    assert tokens(outputs["long"]) == [30, 31, 32, 33, 34]
    assert tokens(outputs["short"]) == [41, 42, 43, 44, 45, 46]
    assert tokens(outputs["late"]) == [62, 63, 64]
    assert all(sum(c.new_lens) <= 8 for c in model.calls)  # the token budget per step
    # decodes went on while the long prompt was still being prefilled in chunks
    assert any(1 in c.new_lens and max(c.new_lens) > 1 for c in model.calls)


def test_whole_prompts_cut_only_the_first_admission_of_a_step():
    """On a GPU (``whole_prompts``) a waiting prompt that would be cut at the end of a
    step's budget waits for the next step, where it goes first; the first admission of
    a step is still cut, so a prompt longer than the budget moves on."""
    from inferd.llm.scheduler import Scheduler, SchedulerConfig
    from inferd.llm.sequence import Sequence

    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_batched_tokens=10,
                                      whole_prompts=True))  # fmt: skip
    seqs = [Sequence(name, list(range(1, n + 1)), greedy(9)) for name, n in
            (("a", 4), ("b", 4), ("c", 4), ("long", 25))]  # fmt: skip
    for seq in seqs:
        sched.add(seq)

    def step() -> list[tuple[str, int]]:
        scheduled = sched.schedule()
        sched.update(scheduled, {s.seq: 7 for s in scheduled if s.samples})
        return [(s.seq.request_id, s.num_tokens) for s in scheduled]

    assert step() == [("a", 4), ("b", 4)]  # "c" would be cut to 2: it waits
    assert step() == [("a", 1), ("b", 1), ("c", 4)]  # "long" would be cut to 4: it waits
    assert step() == [("a", 1), ("b", 1), ("c", 1), ("long", 7)]  # first admission: cut
    assert step() == [("a", 1), ("b", 1), ("c", 1), ("long", 7)]  # its next chunk


def test_preemption_under_a_tiny_block_budget_keeps_outputs_correct():
    eng = engine(num_blocks=8, block_size=2, max_batched_tokens=16)
    for i in range(4):
        eng.add_request(f"r{i}", [10 * (i + 1)] * 3, greedy(6))
    outputs = run_all(eng)
    assert eng.scheduler.preemptions > 0
    for i in range(4):
        start = 10 * (i + 1)
        assert tokens(outputs[f"r{i}"]) == list(range(start + 1, start + 7))
    assert eng.scheduler.allocator.used_count == 0


def test_abort_frees_blocks_at_once():
    eng = engine()
    eng.add_request("a", list(range(1, 20)), greedy(50))
    eng.add_request("b", [3], greedy(50))
    first = eng.step()
    used = eng.scheduler.allocator.used_count
    assert used > 0
    assert eng.abort("a")
    assert eng.scheduler.allocator.used_count < used
    assert not eng.abort("a")
    outputs = run_all(eng)
    assert "a" not in outputs
    assert len([o for o in first if o.request_id == "b"]) + len(outputs["b"]) == 50


def test_a_request_waiting_past_the_queue_timeout_leaves_the_queue():
    eng = engine(max_num_seqs=1, queue_timeout_s=0.05)
    eng.add_request("running", [1], greedy(30))
    eng.add_request("queued", [2], greedy(3))
    eng.step()
    assert [s.request_id for s in eng.scheduler.waiting] == ["queued"]
    time.sleep(0.06)
    outputs = run_all(eng)
    (expired,) = outputs["queued"]
    assert expired.finished and expired.finish_reason == "queue_timeout"
    assert expired.completion_tokens == 0 and expired.prompt_tokens == 1
    assert len(outputs["running"]) == 29  # the running one is never cut short
    assert "queued" not in eng.requests and eng.scheduler.allocator.used_count == 0


def test_a_preempted_request_is_never_expired():
    """Preempted sequences go back to the queue with tokens already streamed: they
    must finish, however long they wait there."""
    eng = engine(num_blocks=4, block_size=2, max_batched_tokens=16, queue_timeout_s=0.02)
    for i in range(3):
        eng.add_request(f"r{i}", [10 * (i + 1)] * 2, greedy(5))
    outputs: dict[str, list] = {}
    while eng.has_work():
        for out in eng.step():
            outputs.setdefault(out.request_id, []).append(out)
        time.sleep(0.03)  # every wait in the queue outlasts the timeout
    assert eng.scheduler.preemptions > 0
    for i in range(3):
        assert tokens(outputs[f"r{i}"]) == list(range(10 * (i + 1) + 1, 10 * (i + 1) + 6))


def test_metrics_count_every_request_and_token():
    eng = engine(max_num_seqs=1)
    eng.add_request("a", [5, 6, 7], greedy(4), arrived=time.monotonic() - 2.0, adapter_name="x")
    eng.add_request("b", [9], greedy(3))
    eng.add_request("c", [1], greedy(50))
    eng.step()
    eng.abort("c")
    run_all(eng)
    m = eng.metrics.snapshot()
    assert m["ttft_s"]["count"] == 2  # a and b produced tokens; c never started
    assert m["itl_s"]["count"] == (4 - 1) + (3 - 1)
    assert m["e2e_s"]["count"] == 2
    assert m["queue_time_s"]["count"] == 2
    # "a" arrived 2 s before the engine got it: its TTFT counts from the arrival.
    assert m["ttft_s"]["sum"] >= 2.0 and m["ttft_s"]["cumulative"][-1] == 2
    assert m["finished"] == {"length": 2, "abort": 1}
    assert m["requests_by_adapter"] == {"x": 1, "": 2}
    assert m["prompt_tokens_total"] == 5 and m["generation_tokens_total"] == 7


def test_eos_stops_unless_ignored():
    eng = engine()
    eng.add_request("eos", [VOCAB - 2], greedy(10))
    eng.add_request("ignore", [VOCAB - 2], greedy(3, ignore_eos=True))
    outputs = run_all(eng)
    assert tokens(outputs["eos"]) == [VOCAB - 1, EOS]
    assert outputs["eos"][-1].finish_reason == "stop"
    assert tokens(outputs["ignore"]) == [VOCAB - 1, EOS, 1]


def test_stop_strings_end_generation_without_emitting_them():
    eng = engine()
    eng.add_request("s", "a", greedy(20, stop=("ef", "zz")))
    outs = run_all(eng)["s"]
    assert "".join(o.text for o in outs) == "bcd"
    assert outs[-1].finish_reason == "stop"


def test_stop_checker_holds_back_partial_matches():
    checker = StopChecker(["END"])
    assert checker.feed("abc E") == ("abc ", False)
    assert checker.feed("N") == ("", False)
    assert checker.feed("Dx") == ("", True)
    other = StopChecker(["END"])
    assert other.feed("E") == ("", False)
    assert other.feed("x") == ("Ex", False)
    assert other.feed("E", final=True) == ("E", False)


def test_seeded_sampling_is_independent_of_batch_company():
    def run(extra: int) -> list[int]:
        eng = engine(model=PlusOneModel(random_logits=True))
        eng.add_request(
            "seeded",
            [7, 8],
            SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=1234),
        )
        for i in range(extra):
            eng.add_request(f"other{i}", [i + 1], SamplingParams(max_tokens=8, seed=i))
        return tokens(run_all(eng)["seeded"])

    assert run(0) == run(3) == run(7)


def test_bad_requests_are_refused():
    eng = engine(max_waiting=2)
    with pytest.raises(ValueError, match="context"):
        eng.add_request("long", [1] * 300, greedy(1))
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("empty", [], greedy(1))
    eng.add_request("a", [1], greedy(1))
    with pytest.raises(ValueError, match="already"):
        eng.add_request("a", [1], greedy(1))
    eng.add_request("b", [1], greedy(1))
    with pytest.raises(EngineFull):
        eng.add_request("c", [1], greedy(1))
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


def test_waiting_sequences_start_best_priority_first_fifo_within_one():
    eng = engine(max_num_seqs=1)
    eng.add_request("busy", [1], greedy(2))
    eng.step()  # "busy" holds the only running slot
    for rid, level in (("low", 3), ("normal", 2), ("high", 1), ("high2", 1), ("batch", 4)):
        eng.add_request(rid, [2], greedy(2, priority=level))
    assert list(run_all(eng)) == ["busy", "high", "high2", "normal", "low", "batch"]


def test_preemption_takes_the_worst_priority_not_the_youngest():
    eng = engine(num_blocks=6, block_size=2, max_batched_tokens=16)  # not enough for both
    low = eng.add_request("low", [10, 10, 10], greedy(6, priority=3))
    high = eng.add_request("high", [20, 20, 20], greedy(6, priority=1))
    outputs = run_all(eng)
    assert low.preemptions >= 1 and high.preemptions == 0
    assert tokens(outputs["low"]) == [11, 12, 13, 14, 15, 16]
    assert tokens(outputs["high"]) == [21, 22, 23, 24, 25, 26]


def test_the_autoscalers_figures_occupancy_waiting_and_ttft():
    eng = engine(max_num_seqs=2, num_blocks=64)
    assert eng.occupancy() == 0.0 and eng.stats()["busy_s"] == 0.0
    for i in range(4):
        eng.add_request(f"r{i}", [1, 2, 3], greedy(20))
    eng.step()
    # two of two slots taken, two waiting for one: a full engine
    assert eng.occupancy() == 1.0 and eng.stats()["waiting"] == 2
    run_all(eng)
    busy = eng.stats()["busy_s"]
    assert 0 < busy <= eng.metrics.step_s.sum + 1e-9
    assert eng.metrics.snapshot()["ttft_sketch"]["count"] == 4
    # one short sequence in a large engine: mostly idle however long its steps are
    roomy = engine(max_num_seqs=16, num_blocks=64)
    roomy.add_request("one", [1], greedy(5))
    run_all(roomy)
    assert roomy.stats()["busy_s"] < roomy.metrics.step_s.sum / 10


# -- vLLM's sampling extensions and OpenAI's penalties ------------------------------------


def text(outs: list) -> str:
    return "".join(o.text for o in outs)


def random_row(token: int) -> torch.Tensor:
    """What ``PlusOneModel(random_logits=True)`` answers after ``token``."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(token))


def test_min_tokens_holds_eos_and_stop_tokens_back_until_reached():
    eng = engine()
    eng.add_request("plain", [VOCAB - 2], greedy(10))
    eng.add_request("min", [VOCAB - 2], greedy(10, min_tokens=4))
    eng.add_request("ids", [VOCAB - 2], greedy(10, min_tokens=4, stop_token_ids=(3,)))
    outputs = run_all(eng)
    assert tokens(outputs["plain"]) == [VOCAB - 1, EOS]
    # EOS masked for 3 more tokens: the next best (all tied) is token 1, then +1 each.
    assert tokens(outputs["min"]) == [VOCAB - 1, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert outputs["min"][-1].finish_reason == "length"
    # Stop token 3, the model's choice after 2, is masked while fewer than 4 were made
    # (the first best left is 1 again); once 4 were, it ends the generation.
    assert tokens(outputs["ids"]) == [VOCAB - 1, 1, 2, 1, 2, 3]
    assert outputs["ids"][-1].finish_reason == "stop"


def test_stop_token_ids_end_the_text_without_or_with_their_text():
    eng = engine()
    eng.add_request("out", "a", greedy(20, stop_token_ids=(ord("d"),)))
    eng.add_request(
        "in", "a", greedy(20, stop_token_ids=(ord("d"),), include_stop_str_in_output=True)
    )
    eng.add_request("str", "a", greedy(20, stop=("ef",), include_stop_str_in_output=True))
    outputs = run_all(eng)
    assert text(outputs["out"]) == "bc" and outputs["out"][-1].finish_reason == "stop"
    assert tokens(outputs["out"]) == [ord("b"), ord("c"), ord("d")]
    assert text(outputs["in"]) == "bcd"
    assert text(outputs["str"]) == "bcdef" and outputs["str"][-1].finish_reason == "stop"


def test_special_tokens_give_text_only_when_not_skipped():
    eng = engine()
    eng.add_request("skip", [VOCAB - 3], greedy(4, ignore_eos=True))
    eng.add_request("keep", [VOCAB - 3], greedy(4, ignore_eos=True, skip_special_tokens=False))
    outputs = run_all(eng)
    assert text(outputs["skip"]) == chr(VOCAB - 2) + chr(VOCAB - 1) + chr(1)
    assert text(outputs["keep"]) == chr(VOCAB - 2) + chr(VOCAB - 1) + "<eos>" + chr(1)


def test_repetition_penalty_follows_its_definition_and_one_is_off():
    prompt = [7, 8, 9]

    def run(**kw) -> list[int]:
        eng = engine(model=PlusOneModel(random_logits=True))
        eng.add_request("r", prompt, greedy(12, ignore_eos=True, **kw))
        return tokens(run_all(eng)["r"])

    plain, neutral, penalized = run(), run(repetition_penalty=1.0), run(repetition_penalty=3.0)
    assert neutral == plain and penalized != plain
    assert len(set(penalized)) > len(set(plain))  # fewer repeats: what it is for
    # Each step: the previous token's row, seen tokens' positive logits / 3, negative * 3.
    seen = list(prompt)
    for token in penalized:
        row = random_row(seen[-1])
        ids = torch.tensor(sorted(set(seen)))
        row[ids] = torch.where(row[ids] > 0, row[ids] / 3.0, row[ids] * 3.0)
        assert token == int(row.argmax())
        seen.append(token)


def test_presence_and_frequency_penalties_count_the_output_only():
    prompt = [7, 8, 9]
    eng = engine(model=PlusOneModel(random_logits=True))
    params = greedy(12, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.7)
    eng.add_request("p", prompt, params)
    out = tokens(run_all(eng)["p"])
    previous, made = prompt[-1], []
    for token in out:
        row = random_row(previous)
        for t in set(made):
            row[t] -= 0.5 + 0.7 * made.count(t)
        assert token == int(row.argmax())
        made.append(token)
        previous = token


def test_min_p_one_keeps_only_the_likeliest_token():
    def run(**kw) -> list[int]:
        eng = engine(model=PlusOneModel(random_logits=True))
        eng.add_request("m", [7], SamplingParams(max_tokens=10, ignore_eos=True, **kw))
        return tokens(run_all(eng)["m"])

    best = run(temperature=0)
    assert run(temperature=1.0, seed=3, min_p=1.0) == best
    assert run(temperature=1.5, seed=3) != best  # without it, the draw wanders


def test_extension_values_out_of_range_are_refused():
    for bad in ({"repetition_penalty": 0}, {"min_p": 1.5}, {"min_tokens": 9}):
        with pytest.raises(ValueError):
            SamplingParams(max_tokens=8, **bad)
