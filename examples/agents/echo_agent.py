#!/usr/bin/env python3
"""A minimal black-box agent for ``rollout.agent_command``: one chat call through the proxy, stdlib only.

Protocol (see services/rollout_worker/agents.py):
* environment: ``OPENAI_BASE_URL`` (the worker's session-scoped proxy URL, ``{proxy}/s/{session}/v1``),
  ``OPENAI_API_KEY`` (``"none"`` when the proxy has no auth), ``DRESSAGE_SESSION_ID``;
* stdin: ``{"messages": [...], "task": "...", "max_new_tokens": N, "temperature": T, "session_id": "..."}``;
* stdout: ``{"reply": "<final answer>"}``, exit 0.
On an HTTP error it prints ``{"error": "<proxy error code>", "message": ...}`` and exits 3, so the
worker classifies e.g. ``partial_rollout_staleness_exceeded`` as that failure.

Use it as ``agent_command: [python, examples/agents/echo_agent.py]``. Any program speaking the
OpenAI chat API works the same way (the ``openai`` client reads OPENAI_BASE_URL/OPENAI_API_KEY).
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request


def chat(base_url: str, api_key: str, messages: list[dict[str, str]], max_tokens: int, temperature: float) -> str:
    body = json.dumps({"model": "policy", "messages": messages, "max_tokens": max_tokens,
                       "temperature": temperature}).encode()
    headers = {"Content-Type": "application/json"}
    if api_key and api_key != "none":
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(f"{base_url.rstrip('/')}/chat/completions", data=body, headers=headers)
    with urllib.request.urlopen(request, timeout=600) as resp:
        answer = json.loads(resp.read())
    return str(answer["choices"][0]["message"]["content"] or "")


def error_code(exc: urllib.error.HTTPError) -> tuple[str, str]:
    """The proxy's error code and message from an error body (``detail`` object or top level)."""
    try:
        body = json.loads(exc.read() or b"{}")
    except ValueError:
        return f"http_{exc.code}", ""
    detail = body.get("detail") if isinstance(body, dict) else None
    detail = detail if isinstance(detail, dict) else (body if isinstance(body, dict) else {})
    return str(detail.get("error") or f"http_{exc.code}"), str(detail.get("message") or "")


def main() -> int:
    task = json.loads(sys.stdin.read())
    try:
        reply = chat(os.environ["OPENAI_BASE_URL"], os.environ.get("OPENAI_API_KEY", "none"), task["messages"],
                     int(task.get("max_new_tokens") or 16), float(task.get("temperature", 1.0)))
    except urllib.error.HTTPError as exc:
        code, message = error_code(exc)
        sys.stdout.write(json.dumps({"error": code, "message": message}) + "\n")
        sys.stderr.write(f"echo_agent: proxy answered {exc.code} {code}: {message}\n")
        return 3
    sys.stdout.write(json.dumps({"reply": reply}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
