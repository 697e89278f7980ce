"""The ``dressage`` command: one subcommand per service or tool, each a lazily imported ``main(argv)``.

Lazy imports keep ``dressage status`` from loading torch, and keep optional extras (SGLang) out of
every process that does not use them.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "prompt-buffer": ("services.prompt_buffer.main", "emit prompt groups from a dataset, paced by the trainer"),
    "rollout-worker": ("services.rollout_worker.main", "roll out prompt groups through the proxy"),
    "proxy": ("services.proxy.main", "LLM proxy with partial rollout and version-span control"),
    "engine": ("services.engine.main", "CPU inference engine speaking SGLang's HTTP API"),
    "group-collector": ("services.group_collector.main", "staleness window + batch assembly"),
    "window-controller": ("services.window_controller.main", "adaptive keep_versions via {p}:control"),
    "trainer": ("services.trainer.main", "GRPO trainer publishing weight versions"),
    "eval-worker": ("services.eval_worker.main", "rq worker running evaluation jobs"),
    "up": ("tools.deploy.up", "run every service locally (private Redis if REDIS_URL is unset)"),
    "status": ("tools.monitor.status", "one screen: streams, groups, versions, window, liveness"),
    "report": ("tools.reports.report", "plots and summary of a run"),
    "replay": ("tools.reports.replay", "the collector's window decisions of a run, recomputed for another window"),
    "experiment": ("tools.experiments.harness", "variants x seeds of a spec as bounded runs, with a report"),
    "init-model": ("tools.dev.init_model", "build a tiny HF model (+ warm start) for a task"),
    "make-data": ("tools.dev.make_data", "generate the built-in task datasets"),
    "check-data": ("tools.dev.check_data", "load a task and read a dataset as the prompt-buffer will"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: dressage <command> [options]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(usage() + "\n")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"dressage: unknown command {name!r}\n\n{usage()}\n")
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
