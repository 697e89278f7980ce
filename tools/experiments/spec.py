"""An experiment spec: base config × named variants × seeds, a stop rule and a quick preset.

Contract: ``load_spec`` either returns a spec whose every run has a valid ``DressageConfig``
(the base YAML + the spec's common ``overrides`` + the variant's overrides + the seed, checked by
``shared.config.load_config`` with the same models as every service) or raises ``SpecError``
naming the offending key -- before any run starts. Overrides use the YAML's keys, either nested
(``pacing: {max_versions_ahead: 0}``), dotted (``pacing.max_versions_ahead: 0``) or as the
environment variable (``DRESSAGE_PACING_MAX_VERSIONS_AHEAD: 0``). The environment of the shell
is NOT applied: a run's ``config.yaml`` is the whole truth about it.

Spec YAML::

    name: async-vs-sync            # folder under runs/experiments/ (optional: the file's stem)
    base: configs/cpu-demo.yaml     # relative to the current directory
    baseline: sync                  # the variant every ratio is taken against
    seeds: [0, 1, 2]                # each sets train.seed, engine.seed and prompt_buffer.shuffle_seed
    stop: {steps: 40}               # or {seconds: 600} or {accuracy: 0.6, max_steps: 200, max_seconds: 900}
    targets: [0.5, 0.6]             # eval-accuracy levels whose time-to-reach goes in summary.csv
    headline: speed                 # the report's first line: speed (baseline's wall-clock to K steps over each
                                    # variant's) or final_eval_acc / best_eval_acc / reward_auc (variant over baseline)
    overrides: {...}                # applied to every variant
    variants: {sync: {...}, async: {...}}
    quick: {seeds: [0, 1], stop: {steps: 10}, variants: [sync, async], overrides: {...}}
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shared.config import ENV_PREFIX, SECTIONS, EvalConfig, load_config, merge_layers, read_yaml_mapping
from shared.errors import ConfigError

NAME = r"^[A-Za-z0-9_.\-]+$"
Headline = Literal["speed", "final_eval_acc", "best_eval_acc", "reward_auc"]


class SpecError(ValueError):
    """A spec that cannot run; the message names the key."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StopRule(Strict):
    """Exactly one of steps / seconds / accuracy; accuracy needs a cap (max_steps and/or max_seconds)."""

    steps: int | None = Field(default=None, ge=1, le=1_000_000)  # trainer steps (train.max_steps)
    seconds: float | None = Field(default=None, gt=0, le=7 * 86400)  # wall-clock of the whole run
    accuracy: float | None = Field(default=None, gt=0, le=1)  # stop once eval accuracy >= this ...
    max_steps: int | None = Field(default=None, ge=1, le=1_000_000)  # ... or after this many steps
    max_seconds: float | None = Field(default=None, gt=0, le=7 * 86400)  # ... or this long

    @model_validator(mode="after")
    def _one_rule(self) -> StopRule:
        chosen = [k for k in ("steps", "seconds", "accuracy") if getattr(self, k) is not None]
        if len(chosen) != 1:
            raise ValueError(f"stop: give exactly one of steps, seconds, accuracy (got {chosen or 'none'})")
        if self.accuracy is None and (self.max_steps is not None or self.max_seconds is not None):
            raise ValueError("stop: max_steps/max_seconds only cap an accuracy rule")
        if self.accuracy is not None and self.max_steps is None and self.max_seconds is None:
            raise ValueError("stop: an accuracy rule needs a cap (max_steps and/or max_seconds)")
        return self

    @property
    def train_steps(self) -> int | None:
        """The trainer's own bound (train.max_steps), if the rule has one."""
        return self.steps if self.steps is not None else self.max_steps

    @property
    def wall_s(self) -> float | None:
        return self.seconds if self.seconds is not None else self.max_seconds

    def describe(self) -> str:
        if self.steps is not None:
            return f"{self.steps} trainer steps"
        if self.seconds is not None:
            return f"{self.seconds:g} s of wall-clock"
        caps = [f"{self.max_steps} steps" if self.max_steps else "", f"{self.max_seconds:g} s" if self.max_seconds else ""]
        return f"eval accuracy >= {self.accuracy:g}, capped at {' / '.join(c for c in caps if c)}"


class QuickPreset(Strict):
    seeds: list[int] | None = Field(default=None, min_length=1)
    stop: StopRule | None = None
    variants: list[str] | None = Field(default=None, min_length=1)  # a subset of the spec's variants
    overrides: dict[str, Any] = Field(default_factory=dict)  # on top of the spec's common overrides


class SpecFile(Strict):
    name: str | None = Field(default=None, pattern=NAME)
    base: str
    baseline: str
    seeds: list[int] = Field(min_length=1)
    stop: StopRule
    targets: list[float] = Field(default_factory=list)
    overrides: dict[str, Any] = Field(default_factory=dict)
    variants: dict[str, dict[str, Any]] = Field(min_length=1)
    quick: QuickPreset | None = None
    description: str = ""
    headline: Headline = "speed"


class Run(Strict):
    """One variant × seed: what ``dressage up`` gets."""

    variant: str
    seed: int
    config: dict[str, Any]  # the merged YAML data written to the run's config.yaml
    max_steps: int | None

    @property
    def key(self) -> str:
        return f"{self.variant}/seed{self.seed}"


class Spec(Strict):
    name: str
    path: str
    quick: bool
    baseline: str
    seeds: list[int]
    stop: StopRule
    targets: list[float]
    variants: list[str]
    runs: list[Run]
    description: str = ""
    headline: Headline = "speed"


def nest(overrides: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """Nested / dotted / DRESSAGE_* keys -> {section: {key: value}}; an unknown section raises SpecError."""
    out: dict[str, dict[str, Any]] = {}

    def put(section: str, key: str, value: Any, shown: str) -> None:
        if section not in SECTIONS:
            raise SpecError(f"{where}: unknown config section {section!r} in {shown!r} "
                            f"(known: {', '.join(SECTIONS)})")
        out.setdefault(section, {})[key] = value

    for raw, value in overrides.items():
        name = str(raw)
        if name.startswith(ENV_PREFIX):
            rest = name[len(ENV_PREFIX):].lower()
            section = next((s for s in sorted(SECTIONS, key=len, reverse=True) if rest.startswith(s + "_")), None)
            if section is None:
                raise SpecError(f"{where}: {name!r} names no config section (DRESSAGE_<SECTION>_<KEY>)")
            put(section, rest[len(section) + 1:], value, name)
        elif "." in name:
            section, _, key = name.partition(".")
            put(section, key, value, name)
        elif isinstance(value, dict):
            for key, v in value.items():
                put(name, str(key), v, f"{name}.{key}")
        else:
            raise SpecError(f"{where}: {name!r} is not a section.key override")
    return out


def merge(*layers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The config's own layering (shared.config.merge_layers); a bad section is a SpecError."""
    try:
        return merge_layers({}, *layers)
    except ConfigError as exc:
        raise SpecError(f"{exc} in the base config") from exc


def seed_overrides(seed: int) -> dict[str, dict[str, Any]]:
    """What a seed changes: the trainer's init RNG, the engine's sampling RNG and the prompt order."""
    return {"train": {"seed": seed}, "engine": {"seed": seed}, "prompt_buffer": {"shuffle_seed": seed}}


def _read_yaml(path: Path, what: str) -> dict[str, Any]:
    try:
        return read_yaml_mapping(path, what)
    except ConfigError as exc:
        raise SpecError(str(exc)) from exc


def _pydantic_message(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors():
        key = ".".join(str(p) for p in e.get("loc", ())) or "(spec)"
        parts.append(f"{key}: {e.get('msg')}")
    return "; ".join(parts)


def _check_subset(where: str, chosen: list[str], available: list[str], baseline: str) -> None:
    """A chosen subset of variants names only ``available`` ones and includes the baseline."""
    unknown = [v for v in chosen if v not in available]
    if unknown:
        raise SpecError(f"{where}: unknown variant(s) {unknown} (variants: {', '.join(available)})")
    if baseline not in chosen:
        raise SpecError(f"{where}: must include the baseline {baseline!r}")


def _check_evaluation(where: str, stop: StopRule, ev: EvalConfig) -> None:
    """An accuracy stop rule needs evaluation during the run; deferred evaluation (``eval.defer``) runs
    only after the trainer's last step, which a run stopped from outside (``stop.seconds``) never takes."""
    if stop.accuracy is not None and not ev.live:
        raise SpecError(f"{where}: stop.accuracy needs evaluation during the run (eval.every_versions > 0 "
                        f"and eval.defer false; got every_versions={ev.every_versions}, "
                        f"defer={str(ev.defer).lower()})")
    if ev.deferred and stop.steps is None:
        raise SpecError(f"{where}: eval.defer evaluates after the trainer's last step: it needs a stop.steps "
                        f"rule (a run stopped by stop.seconds would be left unevaluated)")


def interleaved(runs: list[Run]) -> list[Run]:
    """The order the runs are made in: seed by seed, every variant of a seed (in spec order) before the
    next seed. A drift of the machine's speed during an experiment (other jobs, a neighbour on the host,
    heat) then falls on every variant alike, not on whichever variants happened to run last; and after
    the first seed every variant already has a run to compare. ``Spec.runs`` keeps the spec order."""
    seeds = list(dict.fromkeys(r.seed for r in runs))
    return sorted(runs, key=lambda r: seeds.index(r.seed))  # stable: the variants keep their spec order


def load_spec(path: str | Path, quick: bool = False, only: list[str] | None = None) -> Spec:
    """Parse and validate a spec file, and every run's config (see the module docstring).

    ``only``: run just these variants (``--variants``); they must be the spec's (or its quick preset's)
    and include the baseline. The runs keep their folders, so a later run of the whole spec skips them."""
    p = Path(path)
    try:
        f = SpecFile.model_validate(_read_yaml(p, "experiment spec"))
    except ValidationError as exc:
        raise SpecError(f"experiment spec {p}: {_pydantic_message(exc)}") from exc
    for name in f.variants:
        if not re.match(NAME, name):
            raise SpecError(f"variants: name {name!r} must match {NAME}")
    if f.baseline not in f.variants:
        raise SpecError(f"baseline: {f.baseline!r} is not a variant (variants: {', '.join(f.variants)})")
    seeds, stop, variants, extra = f.seeds, f.stop, list(f.variants), {}
    if quick:
        if f.quick is None:
            raise SpecError("quick: --quick needs a 'quick' preset in the spec")
        seeds = f.quick.seeds or seeds
        stop = f.quick.stop or stop
        variants = f.quick.variants or variants
        extra = f.quick.overrides
        _check_subset("quick.variants", variants, list(f.variants), f.baseline)
    if only is not None:
        _check_subset("--variants", only, variants, f.baseline)
        variants = [v for v in variants if v in only]
    if len(set(seeds)) != len(seeds):
        raise SpecError(f"seeds: duplicates in {seeds}")
    base = _read_yaml(Path(f.base), "base config")
    common = nest(f.overrides, "overrides")
    quick_layer = nest(extra, "quick.overrides")
    runs: list[Run] = []
    for variant in variants:
        layer = nest(f.variants[variant], f"variants.{variant}")
        for seed in seeds:
            stop_layer = {"train": {"max_steps": stop.train_steps}} if stop.train_steps else {}
            data = merge(base, common, quick_layer, layer, seed_overrides(seed), stop_layer)
            try:
                cfg = load_config(None, env={}, overrides=data)
            except ConfigError as exc:
                raise SpecError(f"variants.{variant} (seed {seed}): {exc}") from exc
            _check_evaluation(f"variants.{variant}", stop, cfg.eval)
            runs.append(Run(variant=variant, seed=seed, config=data, max_steps=stop.train_steps))
    name = (f.name or p.stem) + ("-quick" if quick else "")
    return Spec(name=name, path=str(p), quick=quick, baseline=f.baseline, seeds=seeds, stop=stop,
                targets=sorted(f.targets), variants=variants, runs=runs, description=f.description,
                headline=f.headline)
