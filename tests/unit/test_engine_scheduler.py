"""Scheduler core without HTTP: batching equals one-by-one generate, join/leave, abort, swaps, pause."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import cast

import pytest
import torch
from transformers import PreTrainedModel

from services.engine.requests import DuplicateRequest, EngineBusy, GenRequest, GenResult, InvalidRequest
from services.engine.runner import ModelRunner
from services.engine.sampling import SamplingSpec
from services.engine.scheduler import Scheduler
from shared.modeling import ModelSpec, build_model

torch.set_num_threads(1)
VOCAB, EOS = 64, 2
GREEDY = SamplingSpec(temperature=0.0)


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    spec = ModelSpec(hidden_size=64, intermediate_size=128, max_position_embeddings=128)
    return build_model(spec, vocab_size=VOCAB, pad_token_id=0, eos_token_id=EOS, seed=1)


@pytest.fixture
def sched(model: PreTrainedModel) -> Scheduler:
    return Scheduler(ModelRunner(model), weight_version="0", max_batch_size=4, max_queue=8, admit_wait_s=0.0)


class Collector(dict[str, GenResult]):
    def __call__(self, res: GenResult) -> None:
        assert res.rid not in self, f"callback ran twice for {res.rid}"
        self[res.rid] = res


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(4, VOCAB) for _ in range(r.randrange(2, 15))] for _ in range(n)]


def req(rid: str, ids: list[int], n: int = 12, sampling: SamplingSpec = GREEDY,
        stops: frozenset[int] = frozenset({EOS}), logprob_start_len: int = -1) -> GenRequest:
    return GenRequest(rid=rid, input_ids=ids, max_new_tokens=n, sampling=sampling,
                      stop_token_ids=stops, logprob_start_len=logprob_start_len)


def recorder(got: Collector, event: threading.Event, n: int = 1) -> Callable[[GenResult], None]:
    """A submit callback: collect the result, set ``event`` once ``n`` results are in."""
    def on_result(r: GenResult) -> None:
        got(r)
        if len(got) >= n:
            event.set()
    return on_result


def run_all(s: Scheduler) -> None:
    while s.step():
        s.batch.check()


def reference(model: PreTrainedModel, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,  # type: ignore[operator]  # GenerationMixin, mixed into the concrete class
                         eos_token_id=EOS, pad_token_id=0)
    return out[0, len(ids):].tolist()


def direct_logprobs(model: PreTrainedModel, ids: list[int], out: list[int]) -> list[float]:
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids + out])).logits[0].float(), -1)
    return [lp[len(ids) - 1 + j, t].item() for j, t in enumerate(out)]


def test_staggered_greedy_batch_equals_one_by_one_generate(model: PreTrainedModel, sched: Scheduler) -> None:
    got, ps = Collector(), prompts(10)
    lengths = [12 + 2 * i for i in range(10)]
    for i in range(10):  # more requests than max_batch_size, joining between decode steps
        sched.submit(req(str(i), ps[i], lengths[i]), got)
        if i % 3 == 0:
            sched.step()
    run_all(sched)
    assert sched.stats["prefills"] > 1 and sched.counts()["running"] == 0
    for i in range(10):
        assert got[str(i)].output_ids == reference(model, ps[i], lengths[i]), f"row {i}"
        want = direct_logprobs(model, ps[i], got[str(i)].output_ids)
        assert max(abs(a - b) for a, b in zip(want, got[str(i)].output_logprobs, strict=True)) < 1e-4


def test_rows_are_decoded_together_not_one_after_another(sched: Scheduler) -> None:
    got = Collector()
    for i, p in enumerate(prompts(4)):
        sched.submit(req(str(i), p, 10, stops=frozenset()), got)
    run_all(sched)
    assert sched.stats["decode_steps"] == 9  # 4 rows x 10 tokens: one prefill token + 9 shared steps
    assert sched.stats["generated_tokens"] == 40


def test_abort_running_returns_partial_tokens_and_others_continue(model: PreTrainedModel, sched: Scheduler) -> None:
    got, ps = Collector(), prompts(3, seed=5)
    for i in range(3):
        sched.submit(req(str(i), ps[i], 20, stops=frozenset()), got)
    for _ in range(4):
        sched.step()
    fut = sched.abort("1")
    assert not fut.done() and "1" not in got  # queued, not yet applied
    sched.step()  # the abort runs between two forward passes
    assert fut.result(timeout=0) is True
    assert got["1"].finish_reason["type"] == "abort"
    assert 0 < len(got["1"].output_ids) < 20
    assert got["1"].output_ids == reference(model, ps[1], 20)[: len(got["1"].output_ids)]
    run_all(sched)
    for i in (0, 2):
        assert got[str(i)].output_ids == reference(model, ps[i], 20)
        assert got[str(i)].finish_reason == {"type": "length", "length": 20}


def test_burst_stepping_drains_more_requests_than_the_batch_holds(sched: Scheduler) -> None:
    got = Collector()
    sched.max_batch_size = 2
    for i, p in enumerate(prompts(7, seed=4)):
        sched.submit(req(str(i), p, 5, stops=frozenset()), got)
    while sched.step():
        assert sched.counts()["running"] <= 2
    assert sorted(got) == [str(i) for i in range(7)] and sched.counts()["waiting"] == 0


def test_a_trickle_of_joiners_waits_briefly_to_share_one_prefill(model: PreTrainedModel) -> None:
    sched = Scheduler(ModelRunner(model), max_batch_size=4, admit_wait_s=60.0)
    got = Collector()
    sched.submit(req("first", [4, 5], 20, stops=frozenset()), got)
    sched.step()  # an empty batch admits at once
    sched.submit(req("late", [4, 6], 3, stops=frozenset()), got)
    for _ in range(3):
        sched.step()
    assert sched.counts()["running"] == 1 and sched.stats["prefills"] == 1  # "late" is gathering company
    for i in range(2):
        sched.submit(req(f"more{i}", [4, 7], 3, stops=frozenset()), got)  # waiting now fills the batch
    sched.step()
    assert sched.counts()["running"] == 4 and sched.stats["prefills"] == 2
    run_all(sched)
    assert len(got) == 4


def test_abort_waiting_request_returns_no_tokens(sched: Scheduler) -> None:
    got = Collector()
    sched.max_batch_size = 1
    sched.submit(req("a", [5, 6, 7]), got)
    sched.submit(req("b", [5, 6, 8]), got)
    sched.step()
    fut = sched.abort("b")
    sched.step()
    assert fut.result(timeout=0) is True
    assert got["b"].output_ids == [] and got["b"].finish_reason["type"] == "abort"
    assert sched.abort("nope").done() is False  # unknown rid: resolves to False on the next step
    run_all(sched)
    assert got["a"].finish_reason["type"] in ("stop", "length")


def swap_setup(model: PreTrainedModel) -> tuple[ModelRunner, Scheduler, dict[str, torch.Tensor],
                                                 dict[str, torch.Tensor]]:
    """A scheduler on `model`, its weights now, and perturbed weights to swap in."""
    runner = ModelRunner(model)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    return runner, Scheduler(runner, weight_version="0"), original, perturbed


def test_weight_swap_while_paused_applies_at_once(model: PreTrainedModel) -> None:
    runner, sched, original, perturbed = swap_setup(model)
    got = Collector()
    try:
        sched.submit(req("p", [4, 5, 6], 10, stops=frozenset()), got)
        sched.step()
        sched.pause("in_place")
        fut = sched.swap_weights(perturbed, "1", "ckpt-1")
        sched.step()
        assert fut.result(timeout=0) == 0 and sched.weight_version == "1"  # SGLang: no wait while paused
        sched.resume()
        run_all(sched)
    finally:
        runner.load_state(original)
    assert set(got["p"].output_versions) == {"0", "1"}


def test_weight_swap_waits_for_pinned_requests_and_holds_new_ones(model: PreTrainedModel) -> None:
    """SGLang's default: in-flight requests finish on the old weights; newcomers wait for the swap."""
    runner, sched, original, perturbed = swap_setup(model)
    got = Collector()
    try:
        sched.submit(req("old", [4, 5, 6], 10, stops=frozenset()), got)
        for _ in range(3):
            sched.step()
        fut = sched.swap_weights(perturbed, "1", "ckpt-1")
        sched.submit(req("new", [7, 8], 3, stops=frozenset()), got)
        sched.step()
        assert not fut.done() and sched.counts()["swaps_pending"] == 1 and "new" not in got
        assert sched.counts()["waiting"] == 1  # not admitted while the swap waits
        run_all(sched)
        assert fut.result(timeout=0) == 0
        assert got["old"].output_versions == ["0"] * 10 and got["old"].weight_version == "0"
        assert got["new"].output_versions == ["1"] * 3 and sched.weight_version == "1"
    finally:
        runner.load_state(original)
    assert got["old"].output_ids == reference(model, [4, 5, 6], 10)  # old weights only


def test_opted_in_request_runs_across_a_swap_with_per_token_versions(model: PreTrainedModel) -> None:
    runner, sched, original, perturbed = swap_setup(model)
    got = Collector()
    try:
        sched.submit(GenRequest(rid="r", input_ids=[4, 5, 6], max_new_tokens=10, sampling=GREEDY,
                                continue_across_weight_updates=True), got)
        for _ in range(3):
            sched.step()
        fut = sched.swap_weights(perturbed, "1", "ckpt-1")
        run_all(sched)
        assert fut.result(timeout=0) == 0
    finally:
        runner.load_state(original)
    r = got["r"]
    # step 1 = prefill + one decode step, steps 2-3 one decode step each: 4 tokens on "0"
    assert r.output_versions == ["0"] * 4 + ["1"] * 6
    assert r.weight_version == "1" and sched.weight_version == "1" and sched.model_path == "ckpt-1"
    assert r.output_ids[:4] == reference(model, [4, 5, 6], 4)
    old = direct_logprobs(model, [4, 5, 6], r.output_ids)  # every token scored by the old weights
    assert all(abs(a - b) < 1e-4 for a, b in zip(old[:4], r.output_logprobs[:4], strict=True))
    assert all(abs(a - b) > 1e-4 for a, b in zip(old[4:], r.output_logprobs[4:], strict=True))


def test_swap_with_abort_all_aborts_in_flight_first(model: PreTrainedModel, sched: Scheduler) -> None:
    got = Collector()
    sched.submit(req("r", [4, 5, 6], 10, stops=frozenset()), got)
    sched.step()
    fut = sched.swap_weights(dict(model.state_dict()), "2", "same", abort_all=True)
    sched.step()
    assert fut.result(timeout=0) == 1
    assert got["r"].finish_reason["type"] == "abort" and got["r"].output_versions == ["0", "0"]


def test_stop_token_ends_generation_and_is_included(model: PreTrainedModel, sched: Scheduler) -> None:
    ids = [7, 8, 9, 10]
    free = reference(model, ids, 12)
    stop = free[5]
    cut = free.index(stop)
    got = Collector()
    sched.submit(req("s", ids, 12, stops=frozenset({stop, EOS})), got)
    run_all(sched)
    assert got["s"].output_ids == free[: cut + 1]
    assert got["s"].finish_reason == {"type": "stop", "matched": stop}


def test_length_limit_and_context_clamp(model: PreTrainedModel, sched: Scheduler) -> None:
    got = Collector()
    sched.submit(req("short", [4, 5], 3, stops=frozenset()), got)
    sched.submit(req("edge", [4] * 120, 50, stops=frozenset()), got)  # context is 128
    run_all(sched)
    assert got["short"].finish_reason == {"type": "length", "length": 3}
    assert len(got["edge"].output_ids) == 8 and got["edge"].finish_reason["type"] == "length"


def test_zero_new_tokens_returns_prompt_logprobs_only(model: PreTrainedModel, sched: Scheduler) -> None:
    got, ids = Collector(), [4, 9, 13, 21, 30]
    sched.submit(req("z", ids, 0, logprob_start_len=1), got)
    run_all(sched)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
    want = [lp[j - 1, ids[j]].item() for j in range(1, len(ids))]
    r = got["z"]
    assert r.output_ids == [] and r.finish_reason == {"type": "length", "length": 0}
    assert r.input_logprobs is not None and len(r.input_logprobs) == len(ids) - 1
    got_lps = cast("list[float]", r.input_logprobs)  # None only at position 0; logprob_start_len=1
    assert max(abs(a - b) for a, b in zip(want, got_lps, strict=True)) < 1e-4


def test_duplicate_rid_is_rejected_while_in_flight_only(sched: Scheduler) -> None:
    got = Collector()
    sched.submit(req("d", [4, 5], 2), got)
    with pytest.raises(DuplicateRequest, match="'d'"):
        sched.submit(req("d", [4, 5], 2), got)
    run_all(sched)
    sched.submit(req("d", [4, 5], 2), Collector())  # finished: the rid is free again


def test_full_queue_and_bad_ids_are_refused(sched: Scheduler) -> None:
    for i in range(sched.max_batch_size + sched.max_queue):
        sched.submit(req(f"q{i}", [4]), Collector())
    with pytest.raises(EngineBusy):
        sched.submit(req("over", [4]), Collector())
    with pytest.raises(InvalidRequest, match=r"input_ids\[1\]"):
        sched.submit(req("bad", [4, VOCAB]), Collector())
    with pytest.raises(InvalidRequest, match="context"):
        sched.submit(req("long", [4] * 128), Collector())


def test_pause_abort_mode_aborts_all_and_holds_new_requests(sched: Scheduler) -> None:
    got = Collector()
    sched.max_batch_size = 1
    sched.submit(req("run", [4, 5], 20, stops=frozenset()), got)
    sched.submit(req("wait", [4, 6], 20), got)
    sched.step()
    fut = sched.pause("abort")
    sched.submit(req("later", [4, 7], 3, stops=frozenset()), got)
    assert sched.step() is False
    assert fut.result(timeout=0) == 2 and sched.paused
    assert got["run"].finish_reason["type"] == "abort" and len(got["run"].output_ids) == 2
    assert got["wait"].output_ids == [] and "later" not in got
    for _ in range(3):
        assert sched.step() is False  # held while paused
    sched.resume()
    run_all(sched)
    assert len(got["later"].output_ids) == 3


def test_pause_in_place_keeps_requests_and_their_cache(model: PreTrainedModel, sched: Scheduler) -> None:
    got, ids = Collector(), [11, 12, 13]
    sched.submit(req("p", ids, 15), got)
    sched.step()
    sched.pause("in_place")
    for _ in range(3):
        sched.step()
    assert "p" not in got and sched.counts()["running"] == 1
    sched.resume()
    run_all(sched)
    assert got["p"].output_ids == reference(model, ids, 15)


def test_seeded_sampling_is_independent_of_batch_company(sched: Scheduler) -> None:
    spec = SamplingSpec(temperature=1.0, seed=1234)
    alone, crowd = Collector(), Collector()
    sched.submit(req("x", [4, 5, 6], 16, spec, stops=frozenset()), alone)
    run_all(sched)
    for i, p in enumerate(prompts(3, seed=9)):
        sched.submit(req(f"o{i}", p, 16, SamplingSpec(temperature=0.7, top_p=0.9)), crowd)
    sched.step()
    sched.submit(req("x", [4, 5, 6], 16, spec, stops=frozenset()), crowd)
    run_all(sched)
    assert crowd["x"].output_ids == alone["x"].output_ids
    other = Collector()
    sched.submit(req("y", [4, 5, 6], 16, SamplingSpec(temperature=1.0, seed=99), stops=frozenset()), other)
    run_all(sched)
    assert other["y"].output_ids != alone["x"].output_ids


def test_seeded_generation_resumed_from_its_prefix_continues_the_same_tokens(sched: Scheduler) -> None:
    spec, got = SamplingSpec(temperature=1.0, seed=77), Collector()
    sched.submit(req("whole", [4, 5, 6], 14, spec, stops=frozenset()), got)
    run_all(sched)
    whole = got["whole"].output_ids
    sched.submit(req("resumed", [4, 5, 6, *whole[:6]], 8, spec, stops=frozenset()), got)
    run_all(sched)
    assert got["resumed"].output_ids == whole[6:]


def test_thread_mode_serves_concurrent_submitters_and_stop_aborts_leftovers(model: PreTrainedModel) -> None:
    sched = Scheduler(ModelRunner(model), max_batch_size=8)
    got, done = Collector(), threading.Event()
    sched.start()
    try:
        ps = prompts(6, seed=3)
        for i, p in enumerate(ps):
            sched.submit(req(str(i), p, 8), recorder(got, done, 6))
        assert done.wait(20)
        for i, p in enumerate(ps):
            assert got[str(i)].output_ids == reference(model, p, 8)
        sched.pause("in_place").result(5)
        left = Collector()
        sched.submit(req("left", [4, 5], 5), left)
    finally:
        sched.stop()
    assert left["left"].finish_reason["type"] == "abort" and not sched.alive
    with pytest.raises(EngineBusy, match="shutting down"):
        sched.submit(req("after", [4, 5], 2), Collector())


def test_a_failing_forward_aborts_its_rows_and_the_loop_goes_on(model: PreTrainedModel) -> None:
    runner = ModelRunner(model)
    sched = Scheduler(runner)
    real_decode, calls = runner.decode, {"n": 0}

    def flaky(kv, tokens):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_decode(kv, tokens)

    runner.decode = flaky  # type: ignore[method-assign]  # test double shadows the method
    got, ok = Collector(), threading.Event()
    sched.start()
    try:
        sched.submit(req("a", [4, 5], 10, stops=frozenset()), recorder(got, ok))
        assert ok.wait(10)
        ok.clear()
        sched.submit(req("b", [4, 5], 4, stops=frozenset()), recorder(got, ok))
        assert ok.wait(10)
    finally:
        sched.stop()
    assert got["a"].finish_reason == {"type": "abort", "message": "engine error"}
    assert len(got["b"].output_ids) == 4


def test_a_failing_prefill_fails_only_its_joiners(model: PreTrainedModel, sched: Scheduler) -> None:
    got = Collector()
    sched.submit(req("running", [4, 5], 8, stops=frozenset()), got)
    sched.step()
    real_prefill = sched.runner.prefill

    def broken(*a, **k):
        raise RuntimeError("bad prefill")

    sched.runner.prefill = broken  # type: ignore[method-assign]  # test double shadows the method
    sched.submit(req("joiner", [4, 6], 8), got)
    sched.step()
    sched.runner.prefill = real_prefill  # type: ignore[method-assign]  # restores the real method
    run_all(sched)
    assert got["joiner"].finish_reason == {"type": "abort", "message": "engine error"}
    assert got["running"].output_ids == reference(model, [4, 5], 8)  # its batch went on untouched


def test_a_request_being_prefilled_is_still_counted(sched: Scheduler, monkeypatch: pytest.MonkeyPatch) -> None:
    """/get_load and /v1/loads read counts() from another thread: a joiner mid-prefill is in neither
    the queue nor the batch, and was once reported as gone (slime's drain check saw 2 of 3)."""
    seen: list[dict[str, object]] = []
    prefill = sched.runner.prefill

    def observed(*args: object, **kwargs: object) -> object:
        seen.append(sched.counts())  # what another thread would read during this prefill
        return prefill(*args, **kwargs)  # type: ignore[arg-type]  # forwarded unchanged to the real method

    monkeypatch.setattr(sched.runner, "prefill", observed)
    got, done = Collector(), threading.Event()
    for i, ids in enumerate(prompts(3)):
        sched.submit(req(f"r{i}", ids, n=4), recorder(got, done, 3))
    while sched.step():
        pass
    assert done.is_set() and seen
    assert seen[0]["running"] == 0 and seen[0]["waiting"] == 3, seen  # the first prefill admits all three


def test_counts_list_a_request_once_while_it_moves_between_queue_joiners_and_batch(sched: Scheduler) -> None:
    for i, ids in enumerate(prompts(3)):
        sched.submit(req(str(i), ids), lambda r: None)
    sched._drain()  # the three are queued
    a, b, c = list(sched._waiting)
    assert (sched.counts()["running"], sched.counts()["waiting"]) == (0, 3)
    sched._joining = [a]  # _admit lists a joiner before it leaves the queue
    assert (sched.counts()["running"], sched.counts()["waiting"]) == (0, 3)
    sched._waiting.popleft()
    sched.batch.rows.append(a)  # the prefill has put it in the batch; the joiners are cleared after
    assert (sched.counts()["running"], sched.counts()["waiting"]) == (1, 2)
    sched._joining = []
    assert (sched.counts()["running"], sched.counts()["waiting"]) == (1, 2)
    assert {b.req.rid, c.req.rid} == {"1", "2"}
