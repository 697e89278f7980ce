"""Optional metric sinks besides ``{p}:metrics``: Prometheus (``shared.telemetry.MetricGauges``), TensorBoard, wandb.

Each sink is on only when configured *and* its package imports; a missing package is logged once
and never stops training. Values are numbers only (strings such as the version label stay in the
Redis report).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from shared.telemetry import MetricGauges

log = logging.getLogger(__name__)


class MetricSinks:
    def __init__(self, prometheus_port: int | None = None, tensorboard_dir: str | None = None,
                 wandb_project: str | None = None) -> None:
        self._gauges = MetricGauges(prometheus_port) if prometheus_port is not None else None
        self._tb: Any = None
        self._wandb: Any = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(tensorboard_dir)
            except ImportError as exc:
                log.warning("train.tensorboard_dir set but tensorboard is not importable (%s); skipping", exc)
        if wandb_project:
            try:
                import wandb

                self._wandb = wandb.init(project=wandb_project)
            except ImportError as exc:
                log.warning("train.wandb_project set but wandb is not importable (%s); skipping", exc)

    def emit(self, step: int, metrics: Mapping[str, Any]) -> None:
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        if self._gauges is not None:
            self._gauges.set(numbers)
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
