"""Task plugins for the tests of shared.tasks.plugin (loaded by import path ``byo_tasks:<Class>``)."""

from __future__ import annotations

from typing import Any

from shared.tasks import Score, Trajectory


class EchoTask:
    """Reply with the row's ``word``; the prompt is built from the row (no ``prompt`` field needed)."""

    max_new_tokens = 8

    def messages(self, row: dict[str, Any]) -> str:
        return f"say {row['word']}"

    def validate(self, row: dict[str, Any]) -> None:
        if not isinstance(row.get("word"), str):
            raise ValueError("word must be a string")

    def score(self, trajectory: Trajectory, row: dict[str, Any]) -> Score:
        exact = float(trajectory.answer.strip() == row["word"])
        short = float(len(trajectory.answer) <= len(row["word"]) + 2)
        return Score(0.8 * exact + 0.2 * short, {"exact": exact, "short": short})

    def demonstration(self, row: dict[str, Any]) -> list[tuple[list[dict[str, str]], str]]:
        return [([{"role": "user", "content": f"say {row['word']}"}], row["word"])]


class CountdownTask:
    """Multi-turn: the environment answers each reply until the model says 0 (or turns run out)."""

    max_turns = 4

    def env_step(self, trajectory: Trajectory, row: dict[str, Any]) -> str | None:
        return None if trajectory.answer == "0" else f"from {trajectory.answer} count down"

    def score(self, trajectory: Trajectory, row: dict[str, Any]) -> float:
        return 1.0 if trajectory.answer == "0" else 0.0


class RaisingTask:
    def score(self, trajectory: Trajectory, row: dict[str, Any]) -> float:
        raise KeyError("no such column")


class NanTask:
    def score(self, trajectory: Trajectory, row: dict[str, Any]) -> float:
        return float("nan")


class AgentCombined:
    """Half the agent's reported reward, half its own check."""

    agent_reward = "combine"

    def score(self, trajectory: Trajectory, row: dict[str, Any]) -> Score:
        agent = trajectory.agent_reward.reward if trajectory.agent_reward is not None else 0.0
        own = float(trajectory.answer == str(row.get("reference")))
        return Score(0.5 * agent + 0.5 * own, {"agent": agent, "own": own})


class AgentAccepted(AgentCombined):
    agent_reward = "accept"


class AgentRefused(AgentCombined):
    agent_reward = "refuse"


class NoScore:
    max_turns = 1
