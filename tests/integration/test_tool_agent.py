"""The tool-using agent (examples/agents/tool_agent.py, official openai SDK) against a real proxy.

Smoke (normal suite): the agent process runs its tool loop through a real proxy over HTTP; the
engine behind it is the scripted fake (a model that calls ``lookup`` with the prompt's key, then
copies the tool's answer), so the test checks the plumbing -- tools rendered, the call parsed
into ``tool_calls``, the tool result sent back, one recorded trajectory with the call counted --
not a model's skill. Learning (slow, opt-in with ``DRESSAGE_LEARNING=1``, or ``make tool-agent``):
``dressage up --config configs/tool-agent.yaml`` trains the warm-started tiny model and the
report must show reward rising and the share of well-formed tool calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from paths import REPO
from proxy_support import ProxyThread, free_port

from shared.config import ProxyConfig
from shared.modeling.tokenizer import build_tokenizer, save_tokenizer
from shared.tasks import get_task
from shared.tasks.lookup import lookup_value, tool_call_text
from tools.experiments.spec import load_spec
from tools.reports import series
from tools.reports.metricslog import load_rows

sys.path.insert(0, str(REPO / "tests" / "unit"))
from proxy_fake_engine import FakeEngine  # noqa: E402

TOKENIZER = build_tokenizer()
EOS = int(TOKENIZER.eos_token_id)


def ids(text: str) -> list[int]:
    return [int(i) for i in TOKENIZER.encode(text, add_special_tokens=False)] + [EOS]


class ToolModel(FakeEngine):
    """Calls ``lookup`` with the prompt's key; after a tool turn, answers with the tool's result."""

    def _next(self, body: dict[str, Any], produced: list[int], last: int) -> int | None:
        prompt = str(TOKENIZER.decode(body["input_ids"]))
        if "<|im_start|>tool\n" in prompt:
            script = ids(prompt.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0])
        else:
            script = ids(tool_call_text(prompt.rsplit("code of ", 1)[1][:3]))
        self.script = script
        done = self._resumed_from(body) + len(produced)
        return script[done] if done < len(script) else None


@pytest.fixture
def fake_engine_url() -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(ToolModel(step_s=0.0).app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_tool_agent_runs_the_tool_loop_through_the_proxy(tmp_path: Path, fake_engine_url: str) -> None:
    save_tokenizer(TOKENIZER, tmp_path)
    row = get_task("lookup").generate(1, seed=11)[0]
    with ProxyThread(ProxyConfig(engines=[fake_engine_url], follow_versions=False), tmp_path) as p:
        env = {**os.environ, "OPENAI_BASE_URL": f"{p.url}/s/agent-1/v1", "OPENAI_API_KEY": "none"}
        stdin = json.dumps({"messages": [{"role": "user", "content": row["prompt"]}], "task": "lookup",
                            "max_new_tokens": 96, "temperature": 1.0, "session_id": "agent-1"})
        out = subprocess.run([sys.executable, str(REPO / "examples/agents/tool_agent.py")], input=stdin, env=env,
                             capture_output=True, text=True, timeout=120, cwd=REPO)
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout)
        assert answer["reply"] == lookup_value(row["prompt"][8:11])
        episode = get_task("lookup").start(row["prompt"], row["reference"])
        for turn in answer["turns"]:  # what the worker does with them (agents.agent_turns)
            episode.step(turn)
        assert episode.done and episode.correct() and episode.tool_calls == 1  # type: ignore[attr-defined]  # lookup's Episode counts tool calls
        session = httpx.get(f"{p.url}/v1/sessions/agent-1").json()
    assert session["turns"] == 2 and session["num_segments"] == 1  # the tool turn extended the first one
    assert session["samples"][0]["meta"]["tool_calls"] == 1


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("DRESSAGE_LEARNING") != "1", reason="long learning run: DRESSAGE_LEARNING=1 "
                                                                        "or `make tool-agent`")
def test_tool_agent_learns_under_dressage_up(tmp_path: Path) -> None:
    run, model = tmp_path / "run", tmp_path / "lookup-habit-tiny"
    # The call format for half the keys, answers from memory for the other half, as `make tool-agent` builds it.
    subprocess.run([sys.executable, "-m", "services", "init-model", "--task", "lookup", "--out", str(model),
                    "--warm-steps", "450", "--guess-share", "0.5", "--target-accuracy", "0"],
                   cwd=REPO, check=True, timeout=1800)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DRESSAGE_MODEL_PATH": str(model),
           "DRESSAGE_ROLLOUT_AGENT_COMMAND": json.dumps([sys.executable, "examples/agents/tool_agent.py"])}
    env.pop("REDIS_URL", None)
    out = subprocess.run([sys.executable, "-m", "services", "up", "--config", "configs/tool-agent.yaml", "--demo",
                          "--run-dir", str(run), "--quiet"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=3600)
    assert out.returncode == 0, out.stdout[-3000:]
    table = dict(series.summary(load_rows(run / "metrics.jsonl")))
    first = next(v for k, v in table.items() if k.startswith("reward, first"))
    last = next(v for k, v in table.items() if k.startswith("reward, last"))
    well_formed = next(v for k, v in table.items() if k.startswith("well-formed tool calls, last"))
    calling = [float(next(v for k, v in table.items() if k.startswith(f"samples calling a tool, {w}")))
               for w in ("first", "last")]
    assert float(last) > float(first), table
    assert float(well_formed) > 0.5, table
    assert calling[1] > calling[0] + 0.1, table  # the habit of answering from memory is unlearned


def test_tool_agent_experiment_spec_is_valid_and_its_quick_preset_is_small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the spec's base is relative to the repository root
    spec = load_spec(REPO / "configs" / "experiments" / "tool-agent.yaml")
    assert len(spec.seeds) >= 3 and all(r.config["model"]["warm_guess_share"] == 0.5 for r in spec.runs)
    quick = load_spec(REPO / "configs" / "experiments" / "tool-agent.yaml", quick=True)
    assert len(quick.runs) == 1 and quick.stop.steps is not None and quick.stop.steps <= 5
