"""OpenAI chat requests -> ``TurnPlan``: messages for the chat template, tools, sampling (pure).

The chat template receives messages as Hugging Face templates expect them (``role``,
``content`` text, assistant ``tool_calls`` with ``function.arguments`` as given -- JSON text
stays text so the template reproduces what the model wrote -- and ``tool`` turns with
``tool_call_id``/``name``). Content parts other than text (images, audio, files) cannot be read
by a text-only policy and are refused (400 naming the part).
"""

from __future__ import annotations

from typing import Any

from services.proxy.errors import UnsupportedParameter
from services.proxy.schemas import ChatMessage, ChatRequest, NamedToolChoice
from services.proxy.turns import TurnPlan, forced_tool, refuse_strict

TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def template_message(m: ChatMessage, where: str) -> dict[str, Any]:
    if isinstance(m.content, list):
        for j, part in enumerate(m.content):
            if part.type not in TEXT_PARTS:
                raise UnsupportedParameter(f"{where}.content.{j}.type",
                                           f"content part {part.type!r} cannot be read by a text-only policy")
    role = "system" if m.role == "developer" else m.role
    out: dict[str, Any] = {"role": role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def chat_plan(req: ChatRequest, default_max_tokens: int) -> TurnPlan:
    refuse_strict((f"tools.{i}.function.strict", t.function.strict) for i, t in enumerate(req.tools or []))
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    force = None
    if req.tool_choice == "required":
        force = forced_tool(tools, None)
    elif isinstance(req.tool_choice, NamedToolChoice):
        force = forced_tool(tools, str(req.tool_choice.function.get("name")))
    engine: dict[str, Any] = {}
    for name in ("min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            engine[name] = value
    if req.logit_bias:
        engine["logit_bias"] = req.logit_bias
    if req.ignore_eos:
        engine["ignore_eos"] = True
    top = req.top_logprobs or 0
    if top and not req.logprobs:
        raise UnsupportedParameter("top_logprobs", "needs logprobs: true")
    return TurnPlan(
        messages=[template_message(m, f"messages.{i}") for i, m in enumerate(req.messages)],
        max_new_tokens=req.new_tokens(default_max_tokens),
        tools=tools, force_tool=force, one_tool_call=req.parallel_tool_calls is False,
        parse_tools=req.tool_choice != "none", stops=req.stop_strings(), temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, seed=req.seed, engine_params=engine,
        stop_token_ids=req.stop_token_ids, top_logprobs=top, stream=req.stream,
        skip_special_tokens=req.skip_special_tokens, template_kwargs=req.chat_template_kwargs)
