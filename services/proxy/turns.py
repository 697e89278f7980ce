"""One model call of any API surface (chat, Responses, Messages) on the shared session core.

Each surface turns its request into a ``TurnPlan`` (messages in the chat template's shape,
tools, sampling knobs, stop strings, streaming); ``prepare`` renders the prompt with the chat
template and builds the ``TurnOutput`` that turns tokens into content and tool calls;
``run_turn`` runs it through ``ProxyRuntime.turn`` (sessions, partial rollout, version checks,
recording). ``LiveTurn`` runs the same turn in a task and hands its events over as they are
produced, for streamed responses. Invariants:
* every surface records exactly what it returns (``TurnOutput.kept`` tokens);
* a streamed turn that fails before it is admitted (its concurrency slot and session held, the
  version check before its first dispatch passed, or waiting for a resume) is an HTTP error like a
  non-streamed one (``LiveTurn.started``); from then on the stream is open (headers and the first
  event go out at once) and a failure is reported in-band at its end;
* a client that goes away cancels the turn (its engine request is aborted, nothing recorded);
* ``LiveTurn.settled`` after a batch of events counts the output tokens whose text those events
  (and the ones before) cover, so a stream can send each token's logprob once, with its text.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from services.proxy.controller import Generation
from services.proxy.errors import InvalidRequest, UnsupportedParameter
from services.proxy.runtime import ProxyRuntime
from services.proxy.textout import TurnOutput
from shared.toolcalls import Event, call_end, forced_prefix, make_splitter


@dataclass
class TurnPlan:
    """What a request asks of the model, independent of the API surface it came in on."""

    messages: list[dict[str, Any]]  # chat-template messages: role, content, [tool_calls, tool_call_id, name]
    max_new_tokens: int
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools, rendered by the chat template
    parse_tools: bool = True  # False: tool_choice "none" -- the model's text is all content
    stops: tuple[str, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    engine_params: dict[str, Any] = field(default_factory=dict)  # other sampling_params (SGLang names)
    stop_token_ids: list[int] | None = None  # in addition to the end-of-turn ids (SGLang)
    top_logprobs: int = 0
    stream: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    force_tool: str | None = None  # a forced call: "" any tool (required / any), else that function's name
    one_tool_call: bool = False  # parallel_tool_calls false: the turn ends with the first call's closing tag
    template_kwargs: dict[str, Any] | None = None  # chat_template_kwargs of the request (e.g. enable_thinking)


def forced_tool(tools: list[dict[str, Any]] | None, name: str | None) -> str:
    """``TurnPlan.force_tool`` for a client that forces a call (``name`` None: any of ``tools``);
    400 naming ``tool_choice`` when there is nothing to call or no such function."""
    names = [str((t.get("function") or {}).get("name")) for t in tools or []]
    if not names:
        raise UnsupportedParameter("tool_choice", "forcing a tool call needs tools")
    if name is not None and name not in names:
        raise UnsupportedParameter("tool_choice", f"no function named {name!r} in tools ({', '.join(names)})")
    return name or ""


def refuse_strict(flags: Iterable[tuple[str, Any]]) -> None:
    """400 naming the first ``(field path, value)`` that asks for ``strict`` tools: OpenAI's strict
    function calling and Anthropic's strict tool use guarantee arguments that match the schema
    (constrained decoding), which this proxy does not do. ``false`` / absent is what it serves."""
    for where, strict in flags:
        if strict is not None and strict is not False:
            raise UnsupportedParameter(where, "strict tools (arguments guaranteed to match the schema) are not "
                                              "implemented; omit strict or send false")


@dataclass
class TurnResult:
    gen: Generation  # what the engines produced, cut to what the response keeps
    output: TurnOutput  # text, content, tool calls
    prompt_ids: list[int]
    segment: int
    session_id: str


def render_prompt(rt: ProxyRuntime, plan: TurnPlan) -> list[int]:
    """Prompt token ids: the chat template over the messages (and tools), with a generation prompt."""
    if plan.tools and "tools" not in str(getattr(rt.tokenizer, "chat_template", "") or ""):
        raise UnsupportedParameter("tools", "this model's chat template does not render tools")
    try:  # bytes bounded first; special-token text in content stays text (issue 16)
        ids = rt.prompt_ids(plan.messages, plan.tools, plan.template_kwargs)
    except InvalidRequest:
        raise
    except Exception as exc:  # jinja errors: a message shape this template cannot render
        raise InvalidRequest("messages", f"the chat template cannot render these messages ({exc})") from None
    if len(ids) > rt.cfg.max_prompt_tokens:
        raise InvalidRequest("messages", f"prompt is {len(ids)} tokens; proxy.max_prompt_tokens={rt.cfg.max_prompt_tokens}")
    return ids


def prepare(rt: ProxyRuntime, plan: TurnPlan, prompt_ids: list[int] | None = None
            ) -> tuple[list[int], TurnOutput, dict[str, Any], dict[str, Any]]:
    """(prompt ids, output builder, engine sampling params, extra /generate fields)."""
    ids = render_prompt(rt, plan) if prompt_ids is None else prompt_ids
    parser = rt.cfg.tool_call_parser if plan.tools and plan.parse_tools else None
    skip = plan.skip_special_tokens
    kept = (call_end(parser),) if plan.one_tool_call and parser is not None else ()
    stops = (*plan.stops, *kept)
    output = TurnOutput(decode=lambda t: rt.decode(t, skip_special_tokens=skip), splitter=make_splitter(parser),
                        stops=stops, no_stop_trim=plan.no_stop_trim, kept_stops=kept, stream=plan.stream or bool(stops))
    if plan.force_tool is not None:  # the call's start is written for the model: prompt context, not sampled
        if parser is None:
            raise UnsupportedParameter("tool_choice", "forcing a tool call needs proxy.tool_call_parser")
        prefix = forced_prefix(parser, plan.force_tool or None)
        ids = [*ids, *(int(i) for i in rt.tokenizer.encode(prefix, add_special_tokens=False))]
        output.prefill(prefix)  # an open call block (a named function's call starts here)
    # SGLang's rule: stop_token_ids add to the end-of-turn ids, which only ignore_eos drops.
    extra = list(plan.stop_token_ids or ())
    stop_ids = extra if plan.engine_params.get("ignore_eos") else ([*rt.stop_ids, *extra] if extra else None)
    sampling = rt.sampling(plan.temperature, plan.top_p, plan.top_k, plan.seed, stop_ids)
    sampling.update(plan.engine_params)
    fields = {"top_logprobs_num": plan.top_logprobs} if plan.top_logprobs else {}
    return ids, output, sampling, fields


async def _execute(rt: ProxyRuntime, session_id: str, partial: bool, plan: TurnPlan,
                   prepared: tuple[list[int], TurnOutput, dict[str, Any], dict[str, Any]],
                   admitted: Callable[[], None] | None = None) -> TurnResult:
    ids, out, sampling, fields = prepared
    gen, seg = await rt.turn(session_id, partial, ids, plan.max_new_tokens, sampling, out, fields, admitted)
    return _finish(rt, session_id, out, gen, seg, ids)


def _finish(rt: ProxyRuntime, session_id: str, out: TurnOutput, gen: Generation, seg: int,
            ids: list[int]) -> TurnResult:
    """The recorded turn's result; call it with no await since the turn was recorded."""
    out.finish()  # flush held-back text and any open tool-call block
    if out.splitter.well_formed or out.splitter.malformed:  # the tool agent's training metric
        segment = rt.sessions.get(session_id).segments[seg]
        segment.tool_calls += out.splitter.well_formed
        segment.malformed_tool_calls += out.splitter.malformed
    return TurnResult(gen, out, ids, seg, session_id)


async def run_turn(rt: ProxyRuntime, session_id: str, partial: bool, plan: TurnPlan,
                   prompt_ids: list[int] | None = None) -> TurnResult:
    """A whole (non-streamed) turn."""
    prepared = await rt.off_loop(prepare, rt, plan, prompt_ids)  # tokenizing never blocks the event loop
    return await _execute(rt, session_id, partial, plan, prepared)


async def run_turns(rt: ProxyRuntime, session_ids: list[str], partial: bool,
                    plans: list[TurnPlan]) -> list[TurnResult | BaseException]:
    """Whole turns of n sessions at the same messages (n choices): rendered once, their first chunks
    in one engine request (``ProxyRuntime.turn_many``). Results in order; a refused one is its exception."""
    prepared = await rt.off_loop(lambda: [prepare(rt, p) for p in plans])  # the prompt cache renders it once
    ids, fields = prepared[0][0], prepared[0][3]
    if any(p[0] != ids or p[3] != fields for p in prepared):  # cannot happen for one message list; stay exact
        return list(await asyncio.gather(*(_execute(rt, sid, partial, plan, prep) for sid, plan, prep
                                           in zip(session_ids, plans, prepared, strict=True)), return_exceptions=True))
    done = await rt.turn_many(session_ids, partial, ids, plans[0].max_new_tokens, [p[2] for p in prepared],
                              [p[1] for p in prepared], fields)
    out: list[TurnResult | BaseException] = []
    for sid, (_, output, _, _), res in zip(session_ids, prepared, done, strict=True):
        if isinstance(res, BaseException):
            out.append(res)
            continue
        out.append(_finish(rt, sid, output, *res, ids))
    return out


class LiveTurn:
    """A turn running in its own task, its events read as they are produced."""

    def __init__(self, rt: ProxyRuntime, session_id: str, partial: bool, plan: TurnPlan,
                 prepared: tuple[list[int], TurnOutput, dict[str, Any], dict[str, Any]]) -> None:
        self._queue: asyncio.Queue[tuple[list[Event], int] | None] = asyncio.Queue()
        self._admitted = asyncio.Event()
        self.prompt_ids, self.output = prepared[0], prepared[1]
        if self.output.events:  # a forced call's start, written before the model runs
            self._queue.put_nowait((list(self.output.events), 0))
        self.output.listener = lambda events: self._queue.put_nowait((events, self.output.settled()))
        self.task = asyncio.create_task(_execute(rt, session_id, partial, plan, prepared, self._admitted.set))
        self.task.add_done_callback(lambda _: self._queue.put_nowait(None))
        self.settled = 0  # tokens behind the events yielded so far (``TurnOutput.settled`` at their publication)

    @classmethod
    async def start(cls, rt: ProxyRuntime, session_id: str, partial: bool, plan: TurnPlan,
                    prompt_ids: list[int] | None = None) -> LiveTurn:
        """Tokenize on the runtime's tokenizer thread (never on the event loop), then start the turn;
        template and size errors are raised here, before any stream."""
        prepared = await rt.off_loop(prepare, rt, plan, prompt_ids)
        return cls(rt, session_id, partial, plan, prepared)

    async def started(self) -> None:
        """Wait until the turn is admitted (or has ended); a turn refused before that raises here."""
        admitted = asyncio.ensure_future(self._admitted.wait())
        try:
            await asyncio.wait({admitted, self.task}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the client went away before the stream opened
            await self._cancel()
            raise
        finally:
            admitted.cancel()
        if not self._admitted.is_set() and (exc := self.task.exception()) is not None:
            raise exc

    async def events(self) -> AsyncIterator[list[Event]]:
        """Batches of events until the turn ends; then ``result()`` (which may raise)."""
        try:
            while (item := await self._queue.get()) is not None:
                batch, self.settled = item
                yield batch
        finally:
            await self._cancel()  # the client went away: stop generating

    async def _cancel(self) -> None:
        if not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task

    def result(self) -> TurnResult:
        return self.task.result()
