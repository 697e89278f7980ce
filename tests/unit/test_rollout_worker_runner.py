"""Group runner and agents against the fake proxy: concurrency, all-or-nothing groups, black-box agents."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from services.rollout_worker.agents import agent_env, agent_turns, check_agent_command, parse_agent_output
from services.rollout_worker.fake_proxy import FakeProxy, FakeProxyClient, serve
from services.rollout_worker.proxy_client import ClosedSessions, HttpProxyClient, ProxyClient
from services.rollout_worker.runner import GroupFailed, GroupRunner
from shared.codes import STALENESS_EXCEEDED
from shared.config import RolloutConfig
from shared.errors import ConfigError
from shared.schemas import PromptGroup, RolloutGroup

ECHO_AGENT = str(Path(__file__).resolve().parents[2] / "examples" / "agents" / "echo_agent.py")


def solve(sid: str, msgs: list[dict[str, str]]) -> str:
    """A perfect policy: reverses digits; plays the guessing game by binary search on the feedback."""
    first = msgs[0]["content"]
    if first.startswith("reverse "):
        return first.split()[1][::-1]
    low, high = map(int, re.findall(r"\d+", first))
    for reply, feedback in zip(msgs[1::2], msgs[2::2], strict=False):
        guess = int(reply["content"])
        low, high = (guess + 1, high) if feedback["content"] == "higher" else (low, guess - 1)
    return str((low + high) // 2)


def group(**kw: Any) -> PromptGroup:
    base: dict[str, Any] = {"group_id": "g1", "prompt_id": "p1", "task": "reverse", "prompt": "reverse 4821",
                            "reference": "1284", "n_samples": 4, "attempt": 0, "enqueued_at": 1.0}
    return PromptGroup(**{**base, **kw})


def rollout(proxy: ProxyClient, g: PromptGroup, **cfg: Any) -> RolloutGroup:
    return asyncio.run(GroupRunner(proxy, RolloutConfig(**cfg), "w1").run(g))


def failure(proxy: ProxyClient, g: PromptGroup, **cfg: Any) -> GroupFailed:
    with pytest.raises(GroupFailed) as info:
        rollout(proxy, g, **cfg)
    return info.value


def test_trajectories_run_concurrently_and_form_one_completed_group() -> None:
    fake = FakeProxy(reply=solve, version="5", delay_s=0.05)
    rg = rollout(FakeProxyClient(fake), group(n_samples=4))
    assert fake.max_active == 4  # all four model calls were in flight at once
    assert rg.status == "completed" and len(rg.samples) == 4 and len({s.traj_id for s in rg.samples}) == 4
    assert rg.meta["rewards"] == [1.0] * 4 and rg.meta["correct"] == [True] * 4
    assert all(s.reward == 1.0 and s.end_version == "5" for s in rg.samples)
    assert all(sid.startswith("g1-a0-s") for sid in rg.meta["sessions"])
    assert sorted(fake.deleted) == sorted(rg.meta["sessions"]) and fake.sessions == {}
    assert fake.closes == [rg.meta["sessions"]]  # one proxy call closes the whole group
    assert [sid for sid, _ in fake.calls] == rg.meta["sessions"]  # one call for the shared first turn: a choice each


def test_a_failing_shared_first_turn_fails_the_group_and_drops_every_session() -> None:
    fake = FakeProxy(reply=solve, fail=lambda sid, i: STALENESS_EXCEEDED if "-s1-" in sid else None)
    gf = failure(FakeProxyClient(fake), group(n_samples=3))
    assert gf.failure.code == STALENESS_EXCEEDED and "-s1-" in (gf.failure.session_id or "")
    assert len(fake.closes) == 1 and len(fake.deleted) == 3 and fake.sessions == {}


def test_a_session_the_proxy_lost_fails_the_group_and_is_not_closed_twice() -> None:
    fake = FakeProxy(reply=solve)

    class Forgetful(FakeProxyClient):
        async def close_sessions(self, session_ids: list[str], records: bool = True) -> ClosedSessions:
            with fake._lock:
                fake.sessions.pop(session_ids[1])  # expired between its last turn and the close
            return await super().close_sessions(session_ids, records)

    gf = failure(Forgetful(fake), group(n_samples=3))
    assert gf.failure.code == "session_not_found" and (gf.failure.session_id or "").startswith("g1-a0-s1-")
    assert len(fake.closes) == 1 and fake.sessions == {}


def test_wrong_answers_get_partial_credit_from_the_verifier() -> None:
    rg = rollout(FakeProxyClient(FakeProxy(reply=lambda s, m: "1200")), group(n_samples=2))
    assert rg.meta["rewards"] == [pytest.approx(0.45)] * 2 and rg.meta["correct"] == [False, False]


def test_multi_turn_task_loops_with_feedback_and_rewards_the_last_segment() -> None:
    g = group(task="guess", prompt="guess 20-34", reference={"low": 20, "high": 34, "secret": 21}, n_samples=2)
    fake = FakeProxy(reply=solve)
    rg = rollout(FakeProxyClient(fake), g)
    assert rg.meta["turns"] == [3, 3] and rg.meta["rewards"] == [1.0, 1.0]  # 27 -> 23 -> 21
    for sid in rg.meta["sessions"]:
        segs = sorted((s for s in rg.samples if s.traj_id == sid), key=lambda s: s.segment_index)
        assert [s.reward for s in segs] == [0.0, 0.0, 1.0]
    last_call = [m for s, m in fake.calls if s == rg.meta["sessions"][0]][-1]
    assert [m["content"] for m in last_call if m["role"] == "user"][1:] == ["lower", "lower"]


def test_one_failing_trajectory_fails_the_group_cancels_siblings_and_deletes_every_session() -> None:
    # multi-turn: the shared first turn is one call, then s2 fails its second turn while its siblings are slow
    g = group(task="guess", prompt="guess 20-34", reference={"low": 20, "high": 34, "secret": 21}, n_samples=4)
    fake = FakeProxy(reply=solve, fail=lambda sid, i: STALENESS_EXCEEDED if "-s2-" in sid and i == 1 else None)
    client = FakeProxyClient(fake)
    slow = FakeProxyClient(fake)

    async def chat(sid: str, msgs: Any, max_tokens: int, temperature: float) -> str:
        if "-s2-" not in sid:
            await asyncio.sleep(5)  # siblings would take long; they must be cancelled, not awaited
        return await client.chat(sid, msgs, max_tokens, temperature)

    slow.chat = chat  # type: ignore[method-assign,assignment]  # a slow stand-in for the proxy call
    t0 = time.monotonic()
    gf = failure(slow, g)
    assert time.monotonic() - t0 < 2
    assert gf.failure.code == STALENESS_EXCEEDED and "-s2-" in (gf.failure.session_id or "")
    assert len(set(fake.deleted)) == 4 and fake.sessions == {}


def test_trajectory_timeout_fails_the_group() -> None:
    fake = FakeProxy(reply=solve, delay_s=10)
    t0 = time.monotonic()
    gf = failure(FakeProxyClient(fake), group(n_samples=2), trajectory_timeout_s=0.2)
    assert gf.failure.code == "trajectory_timeout" and gf.failure.retryable
    assert time.monotonic() - t0 < 3 and len(fake.deleted) == 2


@pytest.mark.parametrize("kw", [{"task": "chess"}, {"reference": "99999x"}, {"reference": "1111"}])
def test_unusable_prompt_groups_fail_without_retry(kw: dict[str, Any]) -> None:
    fake = FakeProxy(reply=solve)
    gf = failure(FakeProxyClient(fake), group(**kw))
    assert gf.failure.code == "invalid_prompt_group" and not gf.failure.retryable
    assert fake.calls == []


def test_a_bug_in_a_trajectory_propagates_as_itself_after_cleanup() -> None:
    def broken(sid: str, msgs: Any) -> str:
        raise KeyError("bug")

    fake = FakeProxy(reply=broken)
    with pytest.raises(KeyError):
        rollout(FakeProxyClient(fake), group(n_samples=2))
    assert len(fake.deleted) == 2


# -- black-box agents ----------------------------------------------------------------------------


def blackbox(fake: FakeProxy, g: PromptGroup, command: list[str], **cfg: Any) -> RolloutGroup:
    with serve(fake) as url:
        return rollout(HttpProxyClient(url, fake.api_key), g, agent_command=command, **cfg)


def test_echo_agent_calls_the_proxy_through_its_session_url_and_is_scored() -> None:
    fake = FakeProxy(reply=solve, version="2", api_key="k1")
    rg = blackbox(fake, group(n_samples=2), [sys.executable, ECHO_AGENT])
    assert rg.meta["agent"] == "blackbox" and rg.meta["rewards"] == [1.0, 1.0]
    assert sorted({sid for sid, _ in fake.calls}) == sorted(rg.meta["sessions"])
    assert all(s.end_version == "2" and s.reward == 1.0 for s in rg.samples)


def test_agent_gets_its_session_env_and_the_task_on_stdin(tmp_path: Path) -> None:
    dump = tmp_path / "seen.json"
    script = tmp_path / "agent.py"
    script.write_text(
        "import json, os, subprocess, sys\n"
        "data = sys.stdin.read()\n"
        f"open({str(dump)!r}, 'a').write(json.dumps({{'env': dict(os.environ), 'stdin': json.loads(data)}}) + '\\n')\n"
        f"out = subprocess.run([sys.executable, {ECHO_AGENT!r}], input=data.encode(), capture_output=True)\n"
        "sys.stdout.write(json.loads(out.stdout)['reply'])\n")  # plain-text answer
    os.environ["REDIS_PASSWORD"] = "must-not-leak"
    try:
        rg = blackbox(FakeProxy(reply=solve), group(n_samples=1), [sys.executable, str(script)], max_new_tokens=7)
    finally:
        del os.environ["REDIS_PASSWORD"]
    seen = json.loads(dump.read_text())
    sid = rg.meta["sessions"][0]
    env = seen["env"]
    assert env["DRESSAGE_SESSION_ID"] == sid and env["OPENAI_API_KEY"] == "none"
    assert env["OPENAI_BASE_URL"].endswith(f"/s/{sid}/v1") and "REDIS_PASSWORD" not in env
    assert seen["stdin"]["messages"] == [{"role": "user", "content": "reverse 4821"}]
    assert seen["stdin"]["task"] == "reverse" and seen["stdin"]["max_new_tokens"] == 7
    assert rg.meta["rewards"] == [1.0]


def test_agent_relaying_a_staleness_rejection_fails_the_group_with_that_code() -> None:
    fake = FakeProxy(reply=solve, fail=lambda sid, i: STALENESS_EXCEEDED)
    with pytest.raises(GroupFailed) as info:
        blackbox(fake, group(n_samples=2), [sys.executable, ECHO_AGENT])
    assert info.value.failure.code == STALENESS_EXCEEDED and "exited 3" in info.value.failure.message


def test_crashing_agent_fails_the_group() -> None:
    with pytest.raises(GroupFailed) as info:
        blackbox(FakeProxy(), group(n_samples=1), [sys.executable, "-c", "import sys; sys.exit(5)"])
    assert info.value.failure.code == "agent_exit" and "exited 5" in info.value.failure.message


def test_agent_that_never_calls_the_model_has_no_samples() -> None:
    with pytest.raises(GroupFailed) as info:
        blackbox(FakeProxy(), group(n_samples=1), [sys.executable, "-c", "print('1284')"])
    assert info.value.failure.code == "session_not_found"


def test_hanging_agent_is_killed_at_the_trajectory_timeout(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    code = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    t0 = time.monotonic()
    with pytest.raises(GroupFailed) as info:
        blackbox(FakeProxy(), group(n_samples=1), [sys.executable, "-c", code], trajectory_timeout_s=1.0)
    assert info.value.failure.code == "trajectory_timeout" and time.monotonic() - t0 < 10
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_agent_tasks_limits_which_tasks_use_the_agent() -> None:
    fake = FakeProxy(reply=solve)
    rg = rollout(FakeProxyClient(fake), group(n_samples=1), agent_command=["/bin/false"], agent_tasks=["guess"])
    assert rg.meta["agent"] == "whitebox" and rg.meta["rewards"] == [1.0]


@pytest.mark.parametrize("out, reply", [
    (b'{"reply": "1284"}\n', "1284"), (b"  1284 \n", "1284"), (b'{"answer": 1}', '{"answer": 1}'),
    (b'{"reply": null}', ""), (b"\xff\xfe12", "\ufffd\ufffd12"),
])
def test_agent_output_parsing(out: bytes, reply: str) -> None:
    assert parse_agent_output(out) == reply


def test_agent_env_strips_service_secrets_and_sets_the_session() -> None:
    env = agent_env({"PATH": "/bin", "REDIS_URL": "redis://x", "DRESSAGE_REDIS_PASSWORD": "p"}, "http://p/s/x/v1",
                    None, "x")
    assert env == {"PATH": "/bin", "OPENAI_BASE_URL": "http://p/s/x/v1", "OPENAI_API_KEY": "none",
                   "DRESSAGE_SESSION_ID": "x", "ANTHROPIC_BASE_URL": "http://p/s/x", "ANTHROPIC_API_KEY": "none"}


def test_missing_agent_program_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="rollout.agent_command"):
        check_agent_command(["/nonexistent/agent-binary"])
    check_agent_command([sys.executable, ECHO_AGENT])
    check_agent_command(None)


def test_agent_turns_are_the_listed_assistant_turns_else_the_one_reply() -> None:
    assert agent_turns(b'{"reply": "42", "turns": ["<tool_call>x</tool_call>", "42"]}') == [
        "<tool_call>x</tool_call>", "42"]
    assert agent_turns(b'{"reply": "42"}') == ["42"] and agent_turns(b"plain") == ["plain"]
    assert agent_turns(b'{"reply": "7", "turns": [1, 2]}') == ["7"]  # malformed turns: the reply counts
