"""The engine tokenizes a ``text`` prompt off its event loop (issue 16): /health answers meanwhile.

In process: the engine's ASGI app over a real scheduler thread and a tiny model, with a tokenizer the
test holds inside ``encode`` (standing in for a 4 MB text that takes seconds to encode).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import torch

from services.engine.app import build_app
from services.engine.runner import ModelRunner
from services.engine.scheduler import Scheduler
from services.engine.service import EngineService
from shared.modeling import ModelSpec, build_model

torch.set_num_threads(1)
VOCAB, EOS = 64, 2


class HeldTokenizer:
    """Characters as token ids; ``encode`` waits inside until the test releases it."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def encode(self, text: str, **kw: Any) -> list[int]:
        self.started.set()
        assert self.release.wait(10)
        return [4 + ord(ch) % (VOCAB - 4) for ch in text]

    def decode(self, ids: list[int], **kw: Any) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def test_health_answers_while_a_text_prompt_is_tokenized() -> None:
    model = build_model(ModelSpec(hidden_size=64, intermediate_size=128, max_position_embeddings=128),
                        vocab_size=VOCAB, pad_token_id=0, eos_token_id=EOS, seed=1)
    sched = Scheduler(ModelRunner(model), weight_version="0", max_batch_size=4, max_queue=8, admit_wait_s=0.0)
    tok = HeldTokenizer()
    app = build_app(EngineService(sched, tok, eos_ids=[EOS]))
    body = {"text": "a long prompt", "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as c:
            for stream in (False, True):
                tok.started.clear()
                tok.release.clear()
                gen = asyncio.create_task(c.post("/generate", json={**body, "stream": stream}))
                assert await asyncio.to_thread(tok.started.wait, 10)
                health = await asyncio.wait_for(c.get("/health"), 2)  # the loop is free while encode runs
                assert health.status_code == 200 and not gen.done()
                tok.release.set()
                r = await gen
                assert r.status_code == 200, r.text
                assert (r.json()["meta_info"]["prompt_tokens"] == 13 if not stream
                        else r.text.rstrip().endswith("data: [DONE]")), r.text

    sched.start()
    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        sched.stop()
