"""TurnOutput and the Hermes splitter (pure): stop cuts, streamed == whole, tool-call parsing rules."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.proxy.textout import TurnOutput
from shared.toolcalls import HermesSplitter, TextPiece, ToolCall, make_splitter, split, tool_call_metrics

VOCAB = ["ab", "c", "EN", "D", "x", "<tool", "_call>", '{"name": "f", "arguments": {}}', "</tool_call>", " "]


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
    assert (a.final_text, a.kept, a.content(), [c.name for c in a.tool_calls()]) == (
        b.final_text, b.kept, b.content(), [c.name for c in b.tool_calls()])


def test_hermes_blocks_become_calls_and_malformed_ones_stay_text() -> None:
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
