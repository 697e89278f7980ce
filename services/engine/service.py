"""Async operations of the engine: SGLang requests in, scheduler requests out, SGLang responses back.

Invariant: nothing here touches the model or the KV cache. A request is validated
(`protocol.expand`, `protocol.refusals`, the limits below), turned into one `GenRequest` per
sample and handed to the scheduler thread; the handler awaits futures, so the event loop stays
free while tokens are computed. A ``text`` prompt is tokenized on the tokenizer thread, for the same
reason: a 4 MB text takes seconds to encode, and ``/health`` must answer meanwhile. A cancelled caller (client gone) aborts its requests. Weight
updates apply in call order (one lock).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from services.engine.protocol import GenerateBody, Item, UpdateWeightsBody, expand, refusals, render
from services.engine.requests import GenRequest, GenResult, InvalidRequest, UnsupportedField
from services.engine.sampling import SamplingSpec
from services.engine.scheduler import Scheduler
from services.engine.stops import StopChecker, compile_regexes, trim_text
from services.engine.weights import WeightLoadError, check_state, read_checkpoint
from shared.edge import within

log = logging.getLogger(__name__)


class EngineService:
    """See the module docstring; `app.build_app` wraps it in HTTP routes."""

    def __init__(self, scheduler: Scheduler, tokenizer: Any | None, *, eos_ids: Iterable[int] = (),
                 max_new_tokens_limit: int = 4096, tokenizer_path: str | None = None,
                 weight_roots: Iterable[str] | None = None) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer  # None: only input_ids in, empty text out
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.max_new_tokens_limit = max_new_tokens_limit
        self.tokenizer_path = tokenizer_path
        self._update_lock = asyncio.Lock()  # weight updates apply in call order
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-tokenize")
        # update_weights_from_disk loads only from inside these (symlinks resolved); None = anywhere (tests)
        self.weight_roots = tuple(weight_roots) if weight_roots is not None else None

    # ----- request building --------------------------------------------------------------------
    def items(self, body: GenerateBody) -> tuple[bool, list[Item]]:
        """SGLang's normalisation of `body` plus this engine's refusals (400) and limits (422)."""
        refusals(body, [])  # body fields first: input_embeds has no prompt to expand
        try:
            single, items = expand(body)
        except ValueError as exc:
            field = str(exc).split(":", 1)[0] if ":" in str(exc) else "body"
            raise InvalidRequest(field, str(exc)) from None
        refusals(body, [it.sampling for it in items])
        rids = [it.rid for it in items]
        if len(set(rids)) != len(rids):
            raise InvalidRequest("rid", "duplicate request ids within the request")
        return single, items

    def _prompt_ids(self, item: Item) -> list[int]:
        if item.input_ids is not None:
            return item.input_ids
        if self.tokenizer is None:
            raise InvalidRequest("text", "this engine has no tokenizer; send input_ids")
        return [int(i) for i in self.tokenizer.encode(item.text or "")]

    def to_request(self, item: Item, body: GenerateBody) -> GenRequest:
        sp = item.sampling
        max_new = self.max_new_tokens_limit if sp.max_new_tokens is None else sp.max_new_tokens
        if max_new > self.max_new_tokens_limit:
            raise InvalidRequest("sampling_params.max_new_tokens",
                                 f"{max_new} exceeds this engine's limit {self.max_new_tokens_limit}")
        ids = self._prompt_ids(item)
        if item.return_logprob and item.logprob_start_len >= len(ids):
            raise InvalidRequest("logprob_start_len", f"{item.logprob_start_len} is not below the prompt "
                                                      f"length {len(ids)}")
        vocab = self.scheduler.runner.vocab_size
        bias = tuple((int(k), float(v)) for k, v in (sp.logit_bias or {}).items())
        for tok, _ in bias:
            if not 0 <= tok < vocab:
                raise InvalidRequest("sampling_params.logit_bias", f"token id {tok} is outside 0..{vocab - 1}")
        for tok in item.token_ids_logprob:
            if not 0 <= tok < vocab:
                raise InvalidRequest("token_ids_logprob", f"token id {tok} is outside 0..{vocab - 1}")
        stops = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else self.eos_ids)
        return GenRequest(
            rid=item.rid, input_ids=ids, max_new_tokens=max_new,
            sampling=SamplingSpec(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                                  seed=sp.sampling_seed, min_p=sp.min_p, frequency_penalty=sp.frequency_penalty,
                                  presence_penalty=sp.presence_penalty, repetition_penalty=sp.repetition_penalty,
                                  logit_bias=bias, min_new_tokens=sp.min_new_tokens),
            stop_token_ids=frozenset(stops),
            logprob_start_len=item.logprob_start_len if item.return_logprob else -1,
            top_logprobs_num=item.top_logprobs_num if item.return_logprob else 0,
            token_ids_logprob=item.token_ids_logprob if item.return_logprob else (),
            min_new_tokens=sp.min_new_tokens,
            stop_check=self._stop_checker(item),
            continue_across_weight_updates=body.continue_across_weight_updates,
        )

    def _stop_checker(self, item: Item) -> StopChecker | None:
        sp = item.sampling
        strings, regexes = sp.stop_strings(), sp.stop_regexes()
        if not strings and not regexes:
            return None
        if self.tokenizer is None:
            raise UnsupportedField("sampling_params.stop", "stop strings need a tokenizer; this engine has none")
        bad = compile_regexes(regexes)
        if bad is not None:
            raise InvalidRequest("sampling_params.stop_regex", f"{bad!r} is not a valid regular expression")
        tok = self.tokenizer
        return StopChecker(lambda ids: str(tok.decode(ids, skip_special_tokens=sp.skip_special_tokens)),
                           lambda s: list(tok.encode(s, add_special_tokens=False)), strings, regexes)

    # ----- running -----------------------------------------------------------------------------
    async def run(self, req: GenRequest, progress: asyncio.Queue[GenResult] | None = None) -> GenResult:
        """Submit `req` and wait for its result; a cancelled caller aborts the request.

        With `progress`, every token's snapshot (and then the final result) is put on it.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[GenResult] = loop.create_future()

        def settle(res: GenResult) -> None:
            if not fut.done():
                fut.set_result(res)

        def deliver(res: GenResult) -> None:  # runs on the scheduler thread
            loop.call_soon_threadsafe(settle, res)
            if progress is not None:
                loop.call_soon_threadsafe(progress.put_nowait, res)

        def tick(res: GenResult) -> None:  # scheduler thread, streaming only
            assert progress is not None
            loop.call_soon_threadsafe(progress.put_nowait, res)

        self.scheduler.submit(req, deliver, tick if progress is not None else None)
        try:
            return await fut
        except asyncio.CancelledError:
            self.scheduler.abort(req.rid)
            raise

    def _text(self, result: GenResult, item: Item, final: bool) -> str:
        tok, sp = self.tokenizer, item.sampling
        if tok is None:
            return ""

        def decode(ids: list[int]) -> str:
            return str(tok.decode(ids, skip_special_tokens=sp.skip_special_tokens,
                                  spaces_between_special_tokens=sp.spaces_between_special_tokens))
        if not final:
            return decode(result.output_ids)
        return trim_text(result.output_ids, result.finish_reason, decode, sp.no_stop_trim, sp.stop_regexes())

    def _render(self, result: GenResult, item: Item, req: GenRequest, body: GenerateBody, t0: float,
                final: bool = True) -> dict[str, Any]:
        tok = self.tokenizer
        decode_one = (lambda t: tok.decode([t])) if tok is not None else None
        return render(result, item, req.input_ids, self._text(result, item, final), time.perf_counter() - t0,
                      decode_one, body.return_text_in_logprobs, final)

    def _prepare(self, body: GenerateBody) -> tuple[bool, list[Item], list[GenRequest]]:
        single, items = self.items(body)
        return single, items, [self.to_request(it, body) for it in items]

    async def prepare(self, body: GenerateBody) -> tuple[bool, list[Item], list[GenRequest]]:
        """The scheduler requests for `body`; a ``text`` prompt is tokenized off the event loop."""
        if body.text is None:  # input_ids (the proxy's case): nothing slow to do, no thread hop
            return self._prepare(body)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, self._prepare, body)

    async def generate(self, body: GenerateBody) -> dict[str, Any] | list[dict[str, Any]]:
        """A non-streamed ``/generate``: one object, or a list for a batch (grouped by prompt)."""
        t0 = time.perf_counter()
        single, items, reqs = await self.prepare(body)
        results = await asyncio.gather(*(self.run(r) for r in reqs))
        out = [self._render(res, it, rq, body, t0) for res, it, rq in zip(results, items, reqs, strict=True)]
        return out[0] if single else out

    async def stream(self, body: GenerateBody, prepared: tuple[bool, list[Item], list[GenRequest]]
                     ) -> AsyncIterator[bytes]:
        """SSE chunks as SGLang streams them: ``data: {response so far}``, then ``data: [DONE]``.

        Each chunk is the whole response so far (cumulative text and ids, ``finish_reason`` null
        until the last chunk of that sample); batched streams add ``index``. A chunk is sent every
        ``stream_interval`` tokens (default 1) and at the end.
        """
        import json

        t0 = time.perf_counter()
        single, items, reqs = prepared
        queue: asyncio.Queue[GenResult] = asyncio.Queue()
        by_rid = {r.rid: (it, r) for it, r in zip(items, reqs, strict=True)}
        tasks = [asyncio.create_task(self.run(r, queue)) for r in reqs]
        sent = dict.fromkeys(by_rid, 0)
        left = len(reqs)
        try:
            while left:
                res = await queue.get()
                item, req = by_rid[res.rid]
                final = res.finish_reason != {}
                interval = item.sampling.stream_interval or 1
                if not final and len(res.output_ids) - sent[res.rid] < interval:
                    continue
                if final:
                    left -= 1
                sent[res.rid] = len(res.output_ids)
                chunk = self._render(res, item, req, body, t0, final)
                if not single:
                    chunk["index"] = item.index
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()  # a client that went away aborts what still runs

    # ----- control -----------------------------------------------------------------------------
    async def update_weights(self, body: UpdateWeightsBody) -> dict[str, Any]:
        body.refusals()
        path = body.model_path
        if self.weight_roots is not None:
            confined = within(path, self.weight_roots)
            if confined is None:  # same answer whether or not the path exists: nothing about the disk leaks
                raise WeightLoadError("model_path is outside the engine's checkpoint roots")
            path = str(confined)
        async with self._update_lock:
            state = await asyncio.to_thread(read_checkpoint, path)
            await asyncio.to_thread(check_state, self.scheduler.runner.model, state)
            version = body.weight_version or self.scheduler.weight_version
            if body.weight_version is None:  # SGLang keeps the label too, but tokens get mislabelled
                log.warning("weight update without weight_version: new weights keep version=%s path=%s",
                            version, body.model_path)
            n = await asyncio.wrap_future(
                self.scheduler.swap_weights(state, version, body.model_path, body.abort_all_requests))
        return {"success": True, "message": f"weights of {body.model_path} loaded as version {version}",
                "num_paused_requests": n, "weight_version": version}

    def model_info(self) -> dict[str, Any]:
        s = self.scheduler
        return {"model_path": s.model_path, "tokenizer_path": self.tokenizer_path or s.model_path,
                "is_generation": True, "weight_version": s.weight_version,
                "context_length": s.runner.context_len, "vocab_size": s.runner.vocab_size,
                "max_batch_size": s.max_batch_size, "paused": s.paused,
                "preferred_sampling_params": None, "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": getattr(s.runner.model.config, "model_type", None),
                "architectures": getattr(s.runner.model.config, "architectures", None)}

    def loads(self) -> dict[str, Any]:
        """One data-parallel rank's load, SGLang's ``GetLoadsReqOutput`` fields (``/v1/loads``)."""
        s = self.scheduler
        c = s.counts()
        capacity = s.max_batch_size * s.runner.context_len
        used = s.kv_tokens()
        busy = c["running"] / s.max_batch_size if s.max_batch_size else 0.0
        return {
            "dp_rank": 0, "timestamp": time.time(),
            "num_running_reqs": c["running"], "num_waiting_reqs": c["waiting"],
            "num_used_tokens": used, "num_total_tokens": used + s.waiting_tokens(),
            "max_total_num_tokens": capacity, "token_usage": used / capacity if capacity else 0.0,
            "gen_throughput": s.gen_throughput(), "cache_hit_rate": 0.0, "utilization": busy,
            "max_running_requests": s.max_batch_size,
            "queues": {"waiting": c["waiting"], "grammar": 0, "paused": c["waiting"] if s.paused else 0,
                       "retracted": 0},
        }
