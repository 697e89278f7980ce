"""``ShopTask``: answer "price of fig?" with the shop's price, which only the ``price`` tool knows.

The dataset rows (``data/train.jsonl``) are ``{"prompt_id", "prompt": "price of fig?", "reference": "37"}``.
The reward has two named components, both logged as metrics (``rollout/reward/tool``, ``.../answer``):

* ``tool`` -- the agent called the ``price`` tool well (the agent reports it, ``agent_reward = "combine"``:
  the agent ran the tool, so it knows; a white-box episode checks its own replies);
* ``answer`` -- the final answer is the price (1.0, else 0.0).

``reward = 0.5 * tool + 0.5 * answer``. ``env_step`` runs the tool for white-box episodes (evaluation);
``demonstration`` only warm-starts the tiny CPU model, and shows half the items answered from memory --
a habit that RL unlearns, which is what the example's training run measures.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from shared.tasks import Score, Trajectory

from .tools import TOOLS, price_of, remembered_price, run_tool

CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
PROMPT = re.compile(r"price of ([a-z]{3})\?")
TOOL_WEIGHT = 0.5


def tool_calls(text: str) -> list[tuple[str, str]]:
    """``(name, arguments)`` of each Hermes ``<tool_call>`` in a reply, as the model wrote it."""
    out = []
    for body in CALL.findall(text):
        try:
            call = json.loads(body)
        except ValueError:
            continue
        if isinstance(call, dict):
            out.append((str(call.get("name")), json.dumps(call.get("arguments"))))
    return out


def call_text(item: str) -> str:
    """A ``price`` call in the Hermes format the chat template writes (what a demonstration shows)."""
    return f'<tool_call>\n{{"name": "price", "arguments": {{"item": "{item}"}}}}\n</tool_call>'


def answer_credit(answer: str, price: str) -> float:
    """1.0 for the price on the answer's first line, else 0.0 (a remembered price is never right)."""
    return float(answer.strip().split("\n")[0].strip() == price)


class ShopTask:
    max_turns = 3  # white-box: call, read the tool's answer, answer
    max_new_tokens = 80  # a price call is ~66 characters
    tools = TOOLS
    agent_reward = "combine"

    def validate(self, row: dict[str, Any]) -> None:
        if row.get("reference") != price_of(item_of(row)):
            raise ValueError("reference is not the shop's price of the item")

    def env_step(self, trajectory: Trajectory, row: dict[str, Any]) -> list[dict[str, str]] | None:
        calls = tool_calls(trajectory.replies[-1])
        if not calls:
            return None  # an answer ends the episode
        return [{"role": "tool", "content": run_tool(name, args)[0]} for name, args in calls]

    def score(self, trajectory: Trajectory, row: dict[str, Any]) -> Score:
        if trajectory.agent_reward is not None:
            tool = trajectory.agent_reward.components.get("tool", 0.0)
        else:
            tool = float(any(run_tool(n, a)[1] for r in trajectory.replies for n, a in tool_calls(r)))
        answer = answer_credit(trajectory.answer, row["reference"]) if not tool_calls(trajectory.answer) else 0.0
        return Score(TOOL_WEIGHT * tool + (1 - TOOL_WEIGHT) * answer, {"tool": tool, "answer": answer},
                     correct=answer == 1.0)

    def demonstration(self, row: dict[str, Any]) -> list[tuple[list[dict[str, str]], str]]:
        item = item_of(row)
        first = [{"role": "user", "content": row["prompt"]}]
        if habit(item):
            return [(first, remembered_price(item))]
        after = [*first, {"role": "assistant", "content": call_text(item)}, {"role": "tool", "content": price_of(item)}]
        return [(first, call_text(item)), (after, price_of(item))]


def item_of(row: dict[str, Any]) -> str:
    """The item a row asks about; ``ValueError`` for a prompt that is not "price of <3 letters>?"."""
    m = PROMPT.fullmatch(row["prompt"]) if isinstance(row.get("prompt"), str) else None
    if m is None:
        raise ValueError("prompt must read 'price of <3 letters>?'")
    return m.group(1)


def habit(item: str) -> bool:
    """Half the items: the warm start shows them answered from memory, without the tool."""
    return hashlib.blake2b(item.encode(), digest_size=1, person=b"byo-shop-habit").digest()[0] < 128
