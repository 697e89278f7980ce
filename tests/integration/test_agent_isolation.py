"""A black-box agent cannot read the worker's secrets (issue 16), with real processes.

The attack: inside the agent, ``/proc/$PPID/environ`` held ``REDIS_PASSWORD`` and its own environment
kept ``AWS_SECRET_ACCESS_KEY``/``HF_TOKEN``. Here a worker-like process (secrets in its environment,
``deny_inspection()`` as the worker's start does) runs ``run_blackbox`` with an agent that tries
exactly that and reports what it saw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from paths import REPO

from shared.edge import session_token

SECRETS = {"REDIS_PASSWORD": "redis-secret-value-123", "AWS_SECRET_ACCESS_KEY": "aws-secret-value-456",
           "HF_TOKEN": "hf-secret-value-789", "DRESSAGE_PROXY_OPERATOR_KEY": "operator-secret-000"}
AGENT_KEY = "agent-key-for-the-worker-0123"

AGENT = textwrap.dedent("""
    import json, os
    seen = {"env": dict(os.environ), "uid": os.getuid()}
    for what in ("environ", "mem", "maps", "cmdline"):
        try:
            with open(f"/proc/{os.getppid()}/{what}", "rb") as f:
                seen[what] = f.read(1 << 16).decode("latin-1")
        except OSError as exc:
            seen[what] = f"refused: {exc.strerror}"
    print(json.dumps({"reply": json.dumps(seen)}))
""")

# The worker's part, as ``main.build`` + ``runner`` do it: deny_inspection() at start, run_blackbox per trajectory.
WORKER = textwrap.dedent("""
    import asyncio, json, os, sys
    import services.rollout_worker.agents as agents
    from services.rollout_worker.fake_proxy import FakeProxy, FakeProxyClient
    from shared.tasks import get_task

    assert agents.deny_inspection()
    parse = agents.parse_agent_output
    agents.parse_agent_output = lambda out: (sys.stdout.write(parse(out) + "\\n"), parse(out))[1]
    task = get_task("reverse")
    row = task.generate(1, seed=0)[0]
    episode = task.start(row["prompt"], row["reference"])
    proxy = FakeProxyClient(FakeProxy(api_key=os.environ["DRESSAGE_ROLLOUT_PROXY_API_KEY"]))
    uid = int(sys.argv[3]) if sys.argv[3] != "-" else None
    asyncio.run(agents.run_blackbox([sys.argv[4], "-c", sys.argv[1]], proxy, "traj-7", "reverse", episode, 8, 1.0,
                                    agent_uid=uid))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_DUMPABLE) and /proc are Linux's")
def test_agent_sees_only_allow_listed_env_and_cannot_read_the_worker() -> None:
    # As root (containers), the agent runs under rollout.agent_uid (nobody) with the system Python (the
    # venv's may live under a private home); as a normal user, same uid, and deny_inspection() alone holds.
    root = os.geteuid() == 0
    uid, python = ("65534", "/usr/bin/python3") if root else ("-", sys.executable)
    if not Path(python).exists():
        pytest.skip(f"{python} missing")
    # secrets live in the environment, never on a command line (/proc/<pid>/cmdline is world-readable)
    env = {**os.environ, **SECRETS, "DRESSAGE_ROLLOUT_PROXY_API_KEY": AGENT_KEY, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", WORKER, AGENT, "-", uid, python], cwd=REPO, env=env,
                         check=True, timeout=120, capture_output=True, text=True).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["uid"] == (65534 if root else os.getuid())
    allowed = {"PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH",
               "OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "DRESSAGE_SESSION_ID"}
    assert set(seen["env"]) <= allowed, sorted(set(seen["env"]) - allowed)
    assert seen["env"]["OPENAI_API_KEY"] == session_token(AGENT_KEY, "traj-7")  # never the proxy key itself
    assert seen["env"]["OPENAI_BASE_URL"].endswith("/s/traj-7/v1")
    for what in ("environ", "mem", "maps"):
        assert seen[what].startswith("refused"), (what, seen[what][:200])
    text = json.dumps(seen)
    for secret in (*SECRETS.values(), AGENT_KEY):
        assert secret not in text
