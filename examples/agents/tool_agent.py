#!/usr/bin/env python3
"""A tool-using black-box agent, written with the official ``openai`` SDK, for the ``lookup`` task.

Use it as ``rollout.agent_command: [python, examples/agents/tool_agent.py]`` (configs/tool-agent.yaml).
Protocol (services/rollout_worker/agents.py): ``OPENAI_BASE_URL`` is the worker's session URL on
the proxy, so every model call below is recorded as one trajectory; stdin is
``{"messages", "task", "max_new_tokens", "temperature", "session_id"}``; stdout ``{"reply", "turns"}``
(every assistant turn as the model wrote it, so the task scores the tool use too).

The loop is what coding agents do on every turn: send the conversation and the tool list, run
each tool call the model makes and send its result back as a ``tool`` message, until the model
answers without calling a tool (or ``MAX_TURNS`` calls were made). The tool itself is the task's
(``shared.tasks.lookup.run_tool``), so the agent and the verifier agree on what the tool returns.
On a proxy error the agent prints ``{"error": <code>, "message": ...}`` and exits 3, so the worker
classifies e.g. ``partial_rollout_staleness_exceeded`` correctly.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import openai

from shared.tasks.lookup import TOOLS, LookupTask, run_tool
from shared.toolcalls import ToolCall

MAX_TURNS = LookupTask.max_turns


def run(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int,
        temperature: float) -> tuple[str, list[str]]:
    """The agent loop: the model's final answer ("" if it only ever called tools) and every
    assistant turn as the model wrote it (tool calls in their Hermes text), for the task to score."""
    turns: list[str] = []
    for _ in range(MAX_TURNS):
        resp = client.chat.completions.create(model="policy", messages=messages,  # type: ignore[arg-type]
                                              tools=TOOLS, max_tokens=max_tokens,  # type: ignore[arg-type]
                                              temperature=temperature)
        msg = resp.choices[0].message
        if not msg.tool_calls:
            turns.append(msg.content or "")
            return msg.content or "", turns
        messages.append(msg.model_dump(exclude_none=True))  # the assistant turn, tool calls included
        calls = [ToolCall(c.id, c.function.name, c.function.arguments)  # type: ignore[union-attr]
                 for c in msg.tool_calls]
        turns.append((msg.content or "") + "".join(c.hermes() for c in calls))
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    return "", turns


def main() -> int:
    task = json.loads(sys.stdin.read())
    client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ.get("OPENAI_API_KEY", "none"),
                           max_retries=0, timeout=600)
    try:
        reply, turns = run(client, list(task["messages"]), int(task.get("max_new_tokens") or 96),
                           float(task.get("temperature", 1.0)))
    except openai.APIStatusError as exc:
        code = exc.code or f"http_{exc.status_code}"
        sys.stdout.write(json.dumps({"error": code, "message": exc.message}) + "\n")
        sys.stderr.write(f"tool_agent: proxy answered {exc.status_code} {code}: {exc.message}\n")
        return 3
    except openai.APIConnectionError as exc:  # the proxy is unreachable: an infrastructure failure, not the policy's
        sys.stdout.write(json.dumps({"error": "upstream_unavailable", "message": str(exc)}) + "\n")
        return 3
    sys.stdout.write(json.dumps({"reply": reply, "turns": turns}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
