"""One logging setup for every service: ``time level service logger: message`` on stderr.

Messages carry their ids as ``key=value`` pairs (``group_id=… attempt=… version=… entry_id=…``)
so a grep on one id follows a message through every service.
"""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(service: str, level: str | None = None) -> None:
    lvl = (level or os.environ.get("DRESSAGE_LOG_LEVEL") or "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s {service}[%(process)d] %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(lvl)
    for noisy in ("httpx", "httpcore", "urllib3", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
