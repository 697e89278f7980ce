#!/usr/bin/env python3
"""The example's agent, written with the official ``openai`` SDK: a tool loop that reports its own reward.

The contract (docs/guides/your-agent.md): ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` point the SDK at this
trajectory's proxy session, so every model call is recorded; the task arrives on stdin as
``{"messages", "task", "max_new_tokens", "temperature", "session_id"}``; the answer leaves on stdout as
``{"reply", "turns"}`` (every assistant turn as the model wrote it); exit 0. Before answering, the agent
reports what only it knows -- whether its tool call worked -- with ``POST {OPENAI_BASE_URL}/reward``
(``{"reward", "components"}``); the task combines that with its own check of the answer.
A proxy error is printed as ``{"error": <code>}`` with exit 3 (the run retries it, never a zero reward).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import httpx
import openai
from shop.tools import TOOLS, run_tool

MAX_CALLS = 2


def tool_call_text(name: str, arguments: str) -> str:
    """The call as the model wrote it (Hermes format), so the task scores the turn it made."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def run(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int,
        temperature: float) -> tuple[str, list[str], float]:
    """The loop: (final answer, assistant turns, 1.0 if a tool call worked else 0.0)."""
    turns: list[str] = []
    tool_ok = 0.0
    for _ in range(MAX_CALLS + 1):
        resp = client.chat.completions.create(model="policy", messages=messages,  # type: ignore[arg-type]
                                              tools=TOOLS, max_tokens=max_tokens,  # type: ignore[arg-type]
                                              temperature=temperature)
        msg = resp.choices[0].message
        if not msg.tool_calls:
            turns.append(msg.content or "")
            return msg.content or "", turns, tool_ok
        messages.append(msg.model_dump(exclude_none=True))
        turns.append((msg.content or "") + "".join(tool_call_text(c.function.name, c.function.arguments)  # type: ignore[union-attr]
                                                   for c in msg.tool_calls))
        for call in msg.tool_calls:
            answer, ok = run_tool(call.function.name, call.function.arguments)  # type: ignore[union-attr]
            tool_ok = max(tool_ok, float(ok))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
    return "", turns, tool_ok


def main() -> int:
    task = json.loads(sys.stdin.read())
    base, key = os.environ["OPENAI_BASE_URL"], os.environ.get("OPENAI_API_KEY", "none")
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=600)
    try:
        reply, turns, tool_ok = run(client, list(task["messages"]), int(task.get("max_new_tokens") or 64),
                                    float(task.get("temperature", 1.0)))
        report = httpx.post(f"{base}/reward", json={"reward": tool_ok, "components": {"tool": tool_ok}},
                            headers={"Authorization": f"Bearer {key}"}, timeout=60)
        report.raise_for_status()
    except openai.APIStatusError as exc:
        sys.stdout.write(json.dumps({"error": exc.code or f"http_{exc.status_code}", "message": exc.message}) + "\n")
        return 3
    except (openai.APIConnectionError, httpx.HTTPError) as exc:  # the proxy is unreachable: infrastructure
        sys.stdout.write(json.dumps({"error": "upstream_unavailable", "message": str(exc)}) + "\n")
        return 3
    sys.stdout.write(json.dumps({"reply": reply, "turns": turns}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
