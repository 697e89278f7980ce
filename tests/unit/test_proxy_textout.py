"""TurnOutput and the Hermes splitter (pure): stop cuts, streamed == whole, tool-call parsing rules."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from services.proxy.textout import TurnOutput
from shared.toolcalls import (
    ArgsDelta,
    CallDropped,
    CallStart,
    Event,
    HermesSplitter,
    JsonPrefix,
    TextPiece,
    ToolCall,
    make_splitter,
    split,
    tool_call_metrics,
)

VOCAB = ["ab", "c", "EN", "D", "x", "<tool", "_call>", '{"name": "f", "arguments": {}}', "</tool_call>", " ",
         '{"name": "f", "arguments": ', '{"k": ', "1", "}", '"v', '"', ", ", "\n", "<"]
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(max_size=5), lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)


def streamed_calls(events: list[Event]) -> list[tuple[str, str]]:
    """(name, concatenated argument deltas) of every call that completed, checking the event order."""
    open_call: CallStart | None = None
    args, out = "", []
    for e in events:
        if isinstance(e, CallStart):
            assert open_call is None
            open_call, args = e, ""
        elif isinstance(e, ArgsDelta):
            assert open_call is not None and e.id == open_call.id
            args += e.text
        elif isinstance(e, ToolCall | CallDropped):
            assert open_call is not None and e.id == open_call.id
            if isinstance(e, ToolCall):
                assert (e.name, e.arguments) == (open_call.name, args)  # the deltas add up to the call
                out.append((e.name, args))
            open_call = None
        else:
            assert open_call is None  # no text inside a call
    return out


def feed_in_pieces(text: str, cuts: list[int]) -> list[Event]:
    sp, bounds = HermesSplitter(), sorted(cuts)
    return [e for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True) for e in sp.feed(text[a:b])] + sp.finish()


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def run(ids: list[int], stops: tuple[str, ...], listener: bool, step: int = 1) -> TurnOutput:
    got: list[object] = []
    out = TurnOutput(decode=decode, splitter=make_splitter("hermes"), stops=stops,
                     listener=got.extend if listener else None)
    for i in range(0, len(ids), step):
        if out.feed(ids[i:i + step], [-0.5] * len(ids[i:i + step])):
            break
    out.finish()
    if listener:
        assert got == out.events  # a stream carries exactly the events of the whole answer
    return out


def test_a_stop_string_inside_a_token_cuts_text_and_tokens_at_the_same_place() -> None:
    out = run([0, 1, 2, 3, 4], ("cE",), listener=True)
    assert out.final_text == "ab" and out.kept == 1 and out.matched_stop == "cE"
    keep = run([0, 1, 2, 3, 4], ("END",), listener=False, step=5)
    assert keep.final_text == "abc" and keep.kept == 2
    trim = TurnOutput(decode=decode, splitter=make_splitter(None), stops=("END",), no_stop_trim=True)
    trim.feed([0, 1, 2, 3, 4], [0.0] * 5)
    assert trim.kept == 4 and trim.final_text == "abcEND"


@given(st.lists(st.integers(0, len(VOCAB) - 1), max_size=30), st.integers(1, 5), st.booleans())
def test_streamed_and_whole_outputs_agree(ids: list[int], step: int, stops: bool) -> None:
    stop = ("END",) if stops else ()
    a, b = run(ids, stop, listener=True, step=step), run(ids, stop, listener=False, step=len(ids) or 1)
    assert (a.final_text, a.kept, a.content(), [(c.name, c.arguments) for c in a.tool_calls()]) == (
        b.final_text, b.kept, b.content(), [(c.name, c.arguments) for c in b.tool_calls()])
    assert (a.splitter.well_formed, a.splitter.malformed) == (b.splitter.well_formed, b.splitter.malformed)
    assert streamed_calls(a.events) == [(c.name, c.arguments) for c in b.tool_calls()]


@given(JSON_VALUES.map(lambda v: {"v": v}), st.sampled_from([None, 1]), st.booleans(),
       st.lists(st.integers(0, 200), max_size=12))
def test_a_call_streams_its_arguments_as_written_and_they_add_up_to_the_whole_call(
        obj: dict[str, Any], indent: int | None, compact: bool, cuts: list[int]) -> None:
    args = json.dumps(obj, indent=indent, separators=(",", ":") if compact else None)
    text = f'hi <tool_call>\n{{"name": "f", "arguments": {args}}}\n</tool_call>'
    events = feed_in_pieces(text, [min(c, len(text)) for c in cuts])
    assert streamed_calls(events) == [("f", args)] == [(c.name, c.arguments) for c in split(text, "hermes")[1]]
    start = next(i for i, e in enumerate(events) if isinstance(e, CallStart))
    assert isinstance(events[start + 1], ArgsDelta)  # the arguments follow the name, never the outer "}"


def test_a_call_starts_once_its_name_is_written_and_its_arguments_stream_as_they_grow() -> None:
    sp = HermesSplitter()
    assert sp.feed('<tool_call>\n{"name": "lookup", "argu') == []
    (start,) = sp.feed('ments": ')
    assert isinstance(start, CallStart) and start.name == "lookup"
    assert sp.feed('{"key": "q') == [ArgsDelta(start.id, '{"key": "q')]
    assert sp.feed('zt</tool_c') == [ArgsDelta(start.id, "zt")]  # "</tool_c" could end the block: held
    assert sp.feed('"}}\n</tool_call>') == [ArgsDelta(start.id, '</tool_c"}'),
                                               ToolCall(start.id, "lookup", '{"key": "qzt</tool_c"}')]
    sp = HermesSplitter()  # arguments as a JSON string: recognised when the block closes, one delta
    events = [*sp.feed('<tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}'), *sp.feed("</tool_call>")]
    assert [type(e) for e in events] == [CallStart, ArgsDelta, ToolCall]
    whole = split('<tool_call>{"name": "f", "arguments": "{\\"k\\": 1}"}</tool_call>', "hermes")[1][0].arguments
    assert whole == "".join(e.text for e in events if isinstance(e, ArgsDelta)) == '{"k": 1}'


def test_a_started_call_that_turns_out_malformed_is_dropped_and_its_text_is_content_as_when_whole() -> None:
    bad = '<tool_call>\n{"name": "f", "arguments": {"k": qzt}}\n</tool_call>'
    for text in (f"hi {bad}", 'hi <tool_call>{"name": "f", "arguments": {"k": 1'):  # bad JSON; unterminated
        events = feed_in_pieces(text, list(range(len(text))))  # one character at a time
        kinds = [type(e) for e in events]
        assert CallStart in kinds and kinds.index(CallDropped) == len(kinds) - 2 and ToolCall not in kinds
        assert "".join(e.text for e in events if isinstance(e, TextPiece)) == split(text, "hermes")[0] == text


@given(st.text(alphabet='{}[]":,0123456789.eE+-truefalsn x\\/\n', max_size=40))
def test_json_prefix_ends_exactly_where_the_json_module_reads_an_object(tail: str) -> None:
    text = "{" + tail
    scan = JsonPrefix()
    scan.feed(text, 0)
    try:
        end: int | None = json.JSONDecoder().raw_decode(text)[1]
    except ValueError:
        end = None
    assert scan.done == (end is not None) and (end is None or scan.pos == end)


def test_hermes_blocks_become_calls_and_malformed_ones_stay_text() -> None:
    assert split('<tool_call></tool_call> ab', "hermes")[0] == "<tool_call></tool_call> ab"
    assert "".join(e.text for e in feed_in_pieces('<tool_call></tool_call> ab', [23, 24]) if isinstance(e, TextPiece)
                   ) == "<tool_call></tool_call> ab"  # text after a block keeps its leading space, however it arrives
    text = 'hi <tool_call>\n{"name": "f", "arguments": {"k": 1}}\n</tool_call>\n<tool_call>{bad}</tool_call>'
    content, calls = split(text, "hermes")
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"k": 1}')]
    assert content == "hi <tool_call>{bad}</tool_call>"
    sp = HermesSplitter()
    events = [e for ch in text for e in sp.feed(ch)] + sp.finish()  # one character at a time
    assert "".join(e.text for e in events if isinstance(e, TextPiece)) == content
    assert [e.name for e in events if isinstance(e, ToolCall)] == ["f"] and (sp.well_formed, sp.malformed) == (1, 1)
    assert split("answer <tool_ca", "hermes") == ("answer <tool_ca", [])  # a partial start at the end is text


def test_tool_call_metrics_count_well_formed_calls_and_the_samples_that_call() -> None:
    metas = [{"tool_calls": 2}, {"tool_calls": 1, "malformed_tool_calls": 1}, {}, {"malformed_tool_calls": 1}]
    assert tool_call_metrics(metas) == {"tool_calls/well_formed_frac": 3 / 5, "tool_calls/per_sample": 5 / 4,
                                        "tool_calls/sample_frac": 2 / 4}
    assert tool_call_metrics([{}, {}]) == {}  # a task without tools reports nothing


def test_settled_tokens_never_include_text_a_stop_string_could_still_cut() -> None:
    seen: list[tuple[str, int]] = []
    out = TurnOutput(decode=decode, splitter=make_splitter("hermes"), stops=("END",))
    out.listener = lambda evs: seen.append(("".join(e.text for e in evs if isinstance(e, TextPiece)), out.settled()))
    out.feed([0, 1], [0.0] * 2)  # "abc": all but a 2-char tail (the length of "END" less one) is handed on
    out.feed([2], [0.0])  # "abcEN": "EN" may become "END": held back with its token
    assert out.settled() == 2 and out.text == "abcEN"
    out.feed([3], [0.0])  # "END" matched: the cut keeps tokens 0..1
    assert out.stopped and out.settled() == out.kept == 2
    out.finish()
    assert "".join(t for t, _ in seen) == "abc" and [n for _, n in seen] == sorted(n for _, n in seen)
    assert all(len(decode([0, 1][:n])) <= len("".join(t for t, _ in seen[:i + 1])) for i, (_, n) in enumerate(seen))


def test_a_kept_stop_ends_the_output_with_it_while_other_stops_are_trimmed() -> None:
    end = "</tool_call>"
    out = TurnOutput(decode=decode, splitter=make_splitter("hermes"), stops=("END", end), kept_stops=(end,))
    assert out.feed([5, 6, 7, 8, 9, 0, 5, 6, 7, 8], [0.0] * 10)  # a call, then text and a second call
    out.finish()
    assert out.kept == 4 and out.final_text.endswith(end) and len(out.tool_calls()) == 1
    trimmed = TurnOutput(decode=decode, splitter=make_splitter("hermes"), stops=("END", end), kept_stops=(end,))
    assert trimmed.feed([0, 2, 3, 5, 6, 7, 8], [0.0] * 7)  # "abEND..." : END is not kept
    assert trimmed.final_text == "ab" and trimmed.kept == 1
