"""Deployment configuration: one YAML file, one section per service, env overrides, bounds.

``load_config(path)`` reads the YAML (all sections optional), applies environment overrides
``DRESSAGE_<SECTION>_<KEY>`` (e.g. ``DRESSAGE_STALENESS_KEEP_VERSIONS=2``; the retry budget is
``DRESSAGE_ROLLOUT_MAX_RETRIES``) and validates every section. A bad value raises ``ConfigError``
whose message names the key (``section.key``) and the allowed range, so a service stops at start
instead of misbehaving later. Unknown keys are refused too: a typo never silently falls back to a default.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from shared.errors import ConfigError
from shared.keys import Keys
from shared.precision import Precision, lr_problem
from shared.staleness.window import Mode, StalenessConfig

ENV_PREFIX = "DRESSAGE_"
DEV_PASSWORDS = {"", "dressage", "changeme", "password", "redis"}
# The processes `dressage up` starts (ops.service_threads keys).
LOCAL_SERVICES = ("engine", "proxy", "trainer", "group-collector", "eval-worker", "prompt-buffer", "rollout-worker")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class RedisConfig(Section):
    """Connection to the Redis that carries every stream."""

    url: str = "redis://127.0.0.1:6379/0"  # REDIS_URL also overrides this; redis+cluster://, redis+sentinel:// too
    prefix: str = Field(default="dressage", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-{}]+$")
    password: SecretStr | None = None  # REDIS_PASSWORD also overrides this
    require_password: bool = False  # production configs set true: refuse an empty or default password
    socket_timeout_s: float = Field(default=30.0, gt=0, le=600)
    reconnect_backoff_max_s: float = Field(default=5.0, gt=0, le=120)  # bounded exponential backoff cap
    wait_replicas: int = Field(default=0, ge=0, le=16)  # WAIT for this many replicas after every MULTI (Sentinel)
    wait_timeout_ms: int = Field(default=1000, ge=1, le=60_000)  # longest WAIT; a short one is logged, not raised

    def secret(self) -> str | None:
        """The password to log in with: ``redis.password`` (``REDIS_PASSWORD``), else the one in the URL
        (``redis://[user]:<password>@host``, percent-decoded); None when neither has one."""
        if self.password is not None and self.password.get_secret_value():
            return self.password.get_secret_value()
        in_url = urlsplit(self.url).password
        return unquote(in_url) if in_url else None

    def client(self, decode_responses: bool = False) -> Any:
        from shared.redisconn import connect  # local: keep shared.config importable without a Redis client

        return connect(self.url, self.secret(), decode_responses=decode_responses,
                       socket_timeout=self.socket_timeout_s, wait_replicas=self.wait_replicas,
                       wait_timeout_ms=self.wait_timeout_ms)


class ModelConfig(Section):
    """The policy model: a Hugging Face folder or model id (tiny CPU model here, a real checkpoint on GPU)."""

    # A local folder, or a model id ("Qwen/Qwen3-0.6B") resolved to its folder in the Hugging Face cache
    # (HF_HOME; shared/hub.py) when the config is loaded: `hf download <id>` fills the cache first
    path: str = "models/reverse-tiny"
    # The task: a built-in name, an entry point of group dressage.tasks, or an import path "pkg.mod:Class";
    # the default for dataset rows without a "task" field, and the task a tiny model is warm-started on
    task: str = Field(default="reverse", min_length=1, max_length=256)
    # Passed to the chat template wherever it is rendered (the proxy, under a request's own; evaluation),
    # e.g. {enable_thinking: false} for Qwen3's template
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, max_length=32)
    warm_steps: int = Field(default=300, ge=0, le=100_000)
    # share of warm-start rows demonstrated by the task's wrong guess (lookup: answering from memory
    # instead of calling the tool), a habit RL has to unlearn; 0 = demonstrations only
    warm_guess_share: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int = 0


class EngineConfig(Section):
    """CPU inference engine speaking SGLang's HTTP API."""

    host: str = "127.0.0.1"
    port: int = Field(default=30000, ge=1, le=65535)
    model_path: str | None = None  # default: model.path
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_batch_size: int = Field(default=32, ge=1, le=1024)
    max_queue: int = Field(default=1024, ge=1, le=100_000)
    seed: int = 0
    weight_version: str = "0"  # version reported before the first update
    max_prefill_tokens: int = Field(default=8192, ge=1, le=1 << 24)  # padded prompt tokens per prefill pass
    max_new_tokens_limit: int = Field(default=4096, ge=1, le=1 << 20)  # larger max_new_tokens -> 422
    num_threads: int | None = Field(default=None, ge=1, le=1024)  # torch CPU threads; None = torch default
    tokenizer_path: str | None = None  # default: the model directory
    admit_wait_ms: float = Field(default=5.0, ge=0, le=1000)  # arrivals gather this long to share a prefill
    api_key: SecretStr | None = None  # bearer token the proxy (and trainer) send; None = no auth (dev only)
    max_body_bytes: int = Field(default=4 << 20, ge=1024, le=1 << 30)  # larger request bodies -> 413


class ProxyConfig(Section):
    """LLM proxy: sessions, partial rollout and the trajectory version-span limit."""

    host: str = "127.0.0.1"
    port: int = Field(default=8800, ge=1, le=65535)
    engines: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:30000"], min_length=1)
    partial_rollout: bool = True
    max_partial_rollout_preempts: int | None = Field(default=None, ge=0, le=1000)
    # How a new weight version reaches running generations (docs/proxy.md "Live weight updates"):
    # "pause" aborts them, loads, and resumes them from their tokens (a fresh prefill on the new weights);
    # "live" loads while they run: partial-mode requests continue across the swap with per-token versions
    # (their KV cache from the old weights, as in PipelineRL), non-partial ones finish on the old weights first.
    weight_updates: Literal["pause", "live"] = "pause"
    api_key: SecretStr | None = None  # agent-scope bearer token (rollout workers); None + no operator_key = no auth
    operator_key: SecretStr | None = None  # operator-scope token: pause/resume/state/sessions/metrics (docs/security.md)
    engine_api_key: SecretStr | None = None  # bearer token sent to the engines (their engine.api_key)
    max_prompt_bytes: int = Field(default=256 << 10, ge=1024, le=1 << 30)  # message text, refused before tokenizing
    max_body_bytes: int = Field(default=1 << 20, ge=1024, le=1 << 30)
    max_tokens_limit: int = Field(default=4096, ge=1, le=1 << 20)
    max_messages: int = Field(default=256, ge=1, le=100_000)
    max_prompt_tokens: int = Field(default=8192, ge=1, le=1 << 20)
    max_concurrency: int = Field(default=256, ge=1, le=100_000)
    session_ttl_s: float = Field(default=3600.0, gt=0, le=7 * 86400)
    request_timeout_s: float = Field(default=600.0, gt=0, le=86400)
    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    # --- added by the proxy (services/proxy) ---
    tokenizer_path: str | None = None  # chat template + tokenizer directory; None = model.path
    connect_timeout_s: float = Field(default=2.0, gt=0, le=60)  # engine connect timeout: a dead engine is a fast 503
    pause_timeout_s: float = Field(default=30.0, ge=0, le=3600)  # pause waits this long for in-flight rids to return
    follow_versions: bool = True  # follow the version bus ({p}:weights) and load new weights into the engines
    max_sessions: int = Field(default=100_000, ge=1, le=10_000_000)  # live sessions; beyond -> 503 over_capacity
    max_turns_per_session: int = Field(default=1000, ge=1, le=1_000_000)  # beyond -> 409 session_conflict
    # How the model writes tool calls (SGLang's --tool-call-parser): "hermes" (= "qwen25", "qwen3": the
    # <tool_call>{json}</tool_call> format of Qwen models); None = never parse (tools are still rendered).
    tool_call_parser: Literal["hermes", "qwen25", "qwen3"] | None = "hermes"
    # How a thinking model writes its reasoning (SGLang's --reasoning-parser): chat completions then return it as
    # message.reasoning_content and the rest as content (a request's separate_reasoning: false keeps it whole)
    reasoning_parser: Literal["qwen3", "deepseek-r1"] | None = None
    # Engines serve the published weights (docs/proxy.md "Engines at the published version"):
    engine_check_s: float = Field(default=2.0, gt=0, le=300)  # health check of every engine's loaded version
    load_poll_s: float = Field(default=1.0, ge=0, le=300)  # engines' load for routing + /health of down ones; 0 = off
    # An engine's /health answer may take this long: SGLang's runs a one-token generation and answers after
    # >= 1 s (shared/sglang_compat.py), so a down SGLang engine rejoins only with more than that.
    engine_health_timeout_s: float = Field(default=5.0, ge=1.5, le=120)
    engine_sync_wait_s: float = Field(default=10.0, ge=0, le=3600)  # no engine caught up this long -> 503


class PromptBufferConfig(Section):
    """Dataset reader that emits prompt groups."""

    dataset: str = "data/reverse/train.jsonl"
    n_samples: int = Field(default=8, ge=1, le=4096)  # trajectories per GRPO group
    shuffle_seed: int = 0
    epochs: int | None = Field(default=None, ge=1)  # None = forever
    poll_s: float = Field(default=0.2, gt=0, le=60)
    max_stream_len: int = Field(default=100_000, ge=100)


class PacingConfig(Section):
    """Admission control (AReaL-style): groups in flight bounded by the trainer's progress."""

    max_versions_ahead: int | None = Field(default=1, ge=0, le=1000)  # η; 0 = synchronous; None = unbounded
    max_in_flight_groups: int = Field(default=64, ge=1, le=1_000_000)
    # Dead-letter brake (docs/operations.md): at this many dead letters per minute (over the window) the
    # prompt-buffer admits nothing until they fall to half; None = off
    dead_letter_brake_per_min: float | None = Field(default=60.0, gt=0, le=1_000_000)
    dead_letter_brake_window_s: float = Field(default=60.0, ge=1, le=3600)  # the brake's sliding window


class RolloutConfig(Section):
    """Rollout workers and the retry budget (DRESSAGE_ROLLOUT_MAX_RETRIES)."""

    upstream_backoff_max_s: float = Field(default=10.0, gt=0, le=600)  # cap of the wait while proxy/engine are down
    max_retries: int = Field(default=2, ge=0, le=100)  # at most 1 + max_retries attempts per group
    proxy_url: str = "http://127.0.0.1:8800"
    proxy_api_key: SecretStr | None = None
    concurrency: int = Field(default=1, ge=1, le=256)  # groups a worker runs at once
    trajectory_timeout_s: float = Field(default=300.0, gt=0, le=86400)
    claim_idle_ms: int = Field(default=30_000, ge=100, le=86_400_000)  # reclaim pending entries idle this long
    grace_period_s: float = Field(default=20.0, ge=0, le=3600)
    # One blocking read of prompts at a time; a stop waits for it, and what it got stays pending until reclaimed
    block_ms: int = Field(default=250, ge=1, le=60_000)
    temperature: float = Field(default=1.0, ge=0.0, le=10.0)
    max_new_tokens: int | None = Field(default=None, ge=1, le=1 << 20)  # None = the task's own limit
    # Black-box agent: an external command run once per trajectory (argv, no shell; "python" = this environment's
    # interpreter, a relative path from the working directory), with OPENAI_BASE_URL / ANTHROPIC_BASE_URL at its
    # proxy session (docs/guides/your-agent.md); None = the in-process white-box runner.
    agent_command: list[str] | None = Field(default=None, min_length=1, max_length=64)
    agent_tasks: list[str] | None = None  # tasks that use agent_command; None = every task
    # The only environment variables an agent inherits (an allow-list; docs/security.md).
    agent_env: list[str] = Field(default_factory=lambda: ["PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ",
                                                          "TMPDIR", "PYTHONPATH"], max_length=64)
    agent_uid: int | None = Field(default=None, ge=1, le=2**31)  # run agents as this uid/gid (worker must be root)
    session_cleanup_timeout_s: float = Field(default=5.0, gt=0, le=300)  # DELETE of proxy sessions


class StalenessSection(Section):
    """Batch-level staleness control: drop stale groups (the version window) or wait (pacing alone bounds it).

    ``mode: wait`` drops nothing for staleness and cuts batches oldest first (docs/staleness.md); its window
    is 0, the default there, and a non-zero ``keep_versions`` set with it is refused, naming the key.
    """

    # drop: groups outside the window are dropped whole and re-enqueued; wait: nothing is dropped for staleness,
    # batches take the oldest groups first, and pacing.max_versions_ahead alone bounds the staleness
    mode: Mode = "drop"
    keep_versions: int = Field(default=2, ge=0, le=10_000)  # 0 = filter off; must be 0 (its default) in wait mode
    order_by_published: bool = True  # order the window by the trainer's publication log when known

    @model_validator(mode="after")
    def _wait_has_no_window(self) -> StalenessSection:
        if self.mode == "wait" and "keep_versions" not in self.model_fields_set:
            self.keep_versions = 0
        StalenessConfig(self.keep_versions, self.mode)  # the one check (shared.staleness.window)
        return self


class WindowControllerConfig(Section):
    """The adaptive window (services/window_controller): sets ``keep_versions`` live via ``{p}:control``.

    Off by default. Each tick it reads the trainer's off-policy measure (``signal``: the logprob diff,
    the behaviour-vs-proximal mismatch KL, or the effective sample size of the behaviour weights) and
    waiting fraction and the collector's drop rate, and moves the window by at most ``max_step``
    versions: tighter while the measure is on the stale side of its target band, wider while the
    trainer starves or too much is dropped.
    """

    enabled: bool = False  # `dressage up` starts the controller only when true
    interval_s: float = Field(default=10.0, gt=0, le=3600)  # one decision per interval
    min_keep: int = Field(default=1, ge=1, le=1000)  # the window never goes below this (>= 1: never off)
    max_keep: int = Field(default=8, ge=1, le=10_000)
    initial_keep: int | None = Field(default=None, ge=1, le=10_000)  # None = staleness.keep_versions (off: max_keep)
    signal: Literal["logprob_diff", "mismatch_kl", "ess"] = "logprob_diff"  # the measure steered by
    target_logprob_diff: float = Field(default=0.05, gt=0, le=100)  # train_rollout_logprob_abs_diff aimed at
    target_mismatch_kl: float = Field(default=0.05, gt=0, le=100)  # train/mismatch_kl aimed at (signal mismatch_kl)
    # train/ess aimed at (signal ess); the band is on the deficit: 1 - ess within (1 - target_ess) x (1 +- deadband)
    target_ess: float = Field(default=0.9, gt=0, lt=1)
    deadband: float = Field(default=0.3, ge=0, le=10)  # hold while the measure is in target x (1 +- deadband)
    max_wait_fraction: float = Field(default=0.2, gt=0, le=1)  # trainer waiting more: widen, never tighten
    max_drop_rate: float = Field(default=0.4, gt=0, le=1)  # more groups dropped stale than this: widen
    patience: int = Field(default=3, ge=1, le=1000)  # ticks a proposal must repeat (twice as many to reverse)
    starve_patience: int = Field(default=1, ge=1, le=1000)  # ticks of starvation before widening
    stall_ticks: int = Field(default=3, ge=1, le=1000)  # ticks without a trainer step while dropping = starving
    cooldown: int = Field(default=2, ge=0, le=1000)  # ticks with no change after a change (starvation excepted)
    max_step: int = Field(default=1, ge=1, le=100)  # largest change of keep_versions per decision

    @model_validator(mode="after")
    def _bounds(self) -> WindowControllerConfig:
        if self.min_keep > self.max_keep:
            raise ValueError(f"min_keep ({self.min_keep}) must be <= max_keep ({self.max_keep})")
        return self


class CollectorConfig(Section):
    """Group collector: window, batch assembly, re-enqueue."""

    max_ready_batches: int = Field(default=1, ge=1, le=1000)
    claim_idle_ms: int = Field(default=30_000, ge=100, le=86_400_000)
    block_ms: int = Field(default=500, ge=1, le=60_000)
    read_count: int = Field(default=64, ge=1, le=10_000)  # rollout entries per XREADGROUP
    control_poll_s: float = Field(default=1.0, gt=0, le=60)  # re-read {p}:control keep_versions this often
    trim_interval_s: float = Field(default=10.0, ge=0, le=86_400)  # trim acked prompts/rollouts; 0 = never
    metrics_interval_s: float = Field(default=5.0, gt=0, le=3600)  # periodic {p}:metrics report


class TrainConfig(Section):
    """GRPO trainer."""

    groups_per_batch: int = Field(default=4, ge=1, le=4096)
    max_steps: int | None = Field(default=None, ge=1)  # stop after this many trainer steps (batches trained)
    lr: float = Field(default=1e-4, gt=0, le=1.0)
    weight_decay: float = Field(default=0.0, ge=0, le=1.0)
    warmup_steps: int = Field(default=0, ge=0)
    device: str = "cpu"
    # What is kept in which dtype (docs/trainer.md "Precision"): "fp32" = fp32 weights, AdamW state and compute;
    # "bf16-mixed" = fp32 master weights and AdamW state, bf16 forward/backward (GPU runs); "bf16-pure" = bf16
    # weights and AdamW state (half the memory; a step below half a bf16 spacing of its weight is rounded away,
    # so a train.lr too small for it is refused at start)
    precision: Precision = "fp32"
    # dtype of the weights written to every checkpoint the engines load: "auto" = bfloat16 under bf16-mixed and
    # bf16-pure, float32 under fp32. Where it is narrower than the trained weights, durable checkpoints also keep
    # the fp32 master weights (trainer_state.pt), so a restart resumes them exactly
    checkpoint_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # deprecated, use precision: float32 = precision fp32, bfloat16 = precision bf16-pure; float16 is refused
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    micro_batch_size: int = Field(default=16, ge=1, le=4096)
    grad_accum: int = Field(default=1, ge=1, le=4096)
    max_grad_norm: float = Field(default=1.0, gt=0)
    clip_eps: float = Field(default=0.2, gt=0, le=10)
    clip_eps_high: float | None = Field(default=None, gt=0, le=10)
    std_normalize: bool = True
    tis_cap: float | None = Field(default=None, gt=0)  # truncated importance sampling cap; None = off
    kl_coef: float = Field(default=0.0, ge=0)
    mask_nonlast_version_tokens: bool = False
    update_weights_interval: int = Field(default=1, ge=1, le=100_000)
    # Every n-th published version is a durable checkpoint (weights + optimizer + trainer state, fsynced);
    # the n - 1 between are weights-only snapshots (not fsynced) and their batches stay pending until the
    # next durable one (promoted at once whenever the trainer has nothing to train). 1: every version.
    checkpoint_every_versions: int = Field(default=1, ge=1, le=100_000)
    keep_snapshots: int = Field(default=4, ge=1, le=1000)  # weights-only snapshots kept (+ the published one)
    # With a snapshot's batches pending, a trainer that has found no batch for this long makes that version
    # durable at once (idle time, and pacing counts acknowledged groups); a shorter wait does not trigger it.
    durable_when_idle_ms: int = Field(default=250, ge=1, le=60_000)
    # Write the checkpoint, acknowledge and publish on a commit thread while the next step trains (one
    # commit in flight; costs a host copy of weights + optimizer state meanwhile). Off: all on the loop.
    # Off by default (no extra copy unless asked). On the 2-core CPU demo with deferred evaluation it takes the
    # weight-publication pause from 14 % to 0.7 % of wall-clock and pays (async-vs-sync spec; docs/trainer.md).
    background_commit: bool = False
    checkpoint_dir: str = "runs/checkpoints"
    keep_checkpoints: int = Field(default=3, ge=1, le=1000)
    seed: int = 0
    block_ms: int = Field(default=1000, ge=1, le=60_000)
    claim_idle_ms: int = Field(default=600_000, ge=100, le=86_400_000)
    # --- trainer engineer additions ---
    # Stable consumer name in group `trainer`: a restarted trainer re-reads its own pending batches first.
    consumer: str = Field(default="trainer", min_length=1, max_length=128)
    # Consumed stream entry ids remembered in trainer_state.pt to ACK (never retrain) re-delivered batches.
    remember_batch_ids: int = Field(default=10_000, ge=1, le=10_000_000)
    tensorboard_dir: str | None = None  # write TensorBoard scalars here when tensorboard is importable
    wandb_project: str | None = None  # log to wandb when importable (never required)
    # clipped: PPO ratio to the behaviour policy, clipped. decoupled: ratio to the batch's proximal policy (the weights
    # before its first optimizer step), clipped, times min(exp(logp_prox - logp_behaviour), behaviour_weight_cap).
    # naive: no clipping, no behaviour-policy correction
    policy_loss: Literal["clipped", "naive", "decoupled"] = "clipped"
    # decoupled: cap on the behaviour importance weight; any loss: the threshold train/behaviour_weight_truncated_frac
    # counts against (tis_cap instead when that is set)
    behaviour_weight_cap: float = Field(default=5.0, ge=1.0, le=10_000)
    # What a behaviour weight above the cap becomes (decoupled, or tis_cap): truncate: the cap (TIS, slime);
    # mask: 0, the token gets no loss (AReaL's filter: "tokens where behav_imp_weight exceeds the cap")
    behaviour_weight_mode: Literal["truncate", "mask"] = "truncate"
    # Optimizer steps per batch: its rows dealt to this many minibatches, each one optimizer step (and one lr
    # schedule step), every epoch; still one published version per batch. 1 and 1: one optimizer step per batch
    minibatches_per_batch: int = Field(default=1, ge=1, le=1024)
    epochs_per_batch: int = Field(default=1, ge=1, le=64)  # passes over the batch's minibatches
    # Several optimizer steps per batch, the decoupled loss (or tis_cap): where the proximal log-probabilities of
    # minibatches 1.. come from. recompute: a forward without gradient over them before the first update (exact;
    # train/proximal_approx_abs_err then says how far loglinear would have been). loglinear: no extra forward,
    # AReaL's interpolation between each token's behaviour log-probability and the current one by version gap
    proximal_logprobs: Literal["recompute", "loglinear"] = "recompute"
    staleness_weight: Literal["off", "exp", "inverse"] = "off"  # a trajectory's loss weight by its version gap
    staleness_lambda: float = Field(default=0.5, ge=0, le=100)  # exp: exp(-lambda*gap); inverse: 1/(1+lambda*gap)

    @model_validator(mode="after")
    def _precision(self) -> TrainConfig:
        """The deprecated ``dtype`` sets ``precision``; the lr must be one the weights can apply."""
        if self.dtype is not None:
            if self.dtype == "float16":
                raise ValueError("train.dtype=float16 (fp16 training, no loss scaling) is not supported: "
                                 "set train.precision to bf16-mixed or fp32 instead of train.dtype")
            implied: Precision = "fp32" if self.dtype == "float32" else "bf16-pure"
            if "precision" in self.model_fields_set and self.precision != implied:
                raise ValueError(f"train.dtype={self.dtype} (deprecated, = precision {implied}) contradicts "
                                 f"train.precision={self.precision}: remove train.dtype")
            self.precision = implied
        problem = lr_problem(self.lr, self.precision)
        if problem is not None:
            raise ValueError(problem + (f" (train.precision was set by train.dtype={self.dtype})" if self.dtype else ""))
        return self

    @model_validator(mode="after")
    def _naive_has_no_correction(self) -> TrainConfig:
        if self.policy_loss == "naive" and self.tis_cap is not None:
            raise ValueError("policy_loss 'naive' has no behaviour-policy correction: leave tis_cap unset")
        if self.policy_loss == "decoupled" and self.tis_cap is not None:
            raise ValueError("train.policy_loss 'decoupled' truncates its weight at train.behaviour_weight_cap: "
                             "leave train.tis_cap unset (clipped + tis_cap is the same objective)")
        if self.proximal_logprobs == "loglinear" and self.policy_loss != "decoupled" and self.tis_cap is None:
            raise ValueError(f"train.proximal_logprobs 'loglinear' approximates the proximal policy of the decoupled "
                             f"loss (or tis_cap); train.policy_loss {self.policy_loss!r} does not use one")
        return self

    # --- scale-out (torchrun) ---
    parallel: Literal["ddp", "fsdp"] = "ddp"  # under torchrun: DDP (replicated) or FSDP2 fully_shard (sharded)
    dist_timeout_s: float = Field(default=600.0, ge=10, le=86_400)  # a collective waiting longer fails the step


class EvalConfig(Section):
    """Evaluation jobs (rq) on held-out data."""

    every_versions: int = Field(default=0, ge=0, le=100_000)  # 0 = off
    dataset: str = "data/reverse/test.jsonl"
    n_examples: int = Field(default=64, ge=1, le=1_000_000)
    queue: str = "dressage-eval"
    # --- trainer engineer additions ---
    job_timeout_s: int = Field(default=1800, ge=10, le=86_400)  # rq job timeout per evaluation
    batch_size: int = Field(default=64, ge=1, le=4096)  # prompts decoded together (greedy)
    device: str = "cpu"  # where the eval worker loads the checkpoint
    data_root: str = "data"  # the eval worker refuses a job whose dataset resolves outside this directory
    # true: `dressage up` runs no eval worker during the run; the versions' jobs wait in the queue (their
    # checkpoints kept) and one burst eval worker runs them after the trainer's last step. Evaluation then
    # takes no CPU from the run it measures (timing comparisons); time-to-accuracy still counts from each
    # version's publication. Live readers (`dressage status`, accuracy stop rules) see no accuracy until then
    defer: bool = False

    @property
    def live(self) -> bool:
        """An eval worker runs beside the pipeline (evaluation on, not deferred)."""
        return self.every_versions > 0 and not self.defer

    @property
    def deferred(self) -> bool:
        """Evaluation on, run by a burst eval worker after the trainer's last step."""
        return self.every_versions > 0 and self.defer


def _check_service_names(value: dict[str, Any]) -> None:
    """A per-service setting of ``dressage up`` names only services it starts."""
    for name in value:
        if name not in LOCAL_SERVICES:
            raise ValueError(f"unknown service {name!r} (known: {', '.join(LOCAL_SERVICES)})")


def _per_service(value: dict[str, int], low: int, high: int, what: str) -> dict[str, int]:
    """A per-service number of ``dressage up``: known service names, values within [low, high]."""
    _check_service_names(value)
    for name, n in value.items():
        if not low <= n <= high:
            raise ValueError(f"{name}: {what} must be between {low} and {high}, got {n}")
    return value


class OpsConfig(Section):
    """dressage up / status / report."""

    run_dir: str = "runs"
    heartbeat_ttl_s: float = Field(default=15.0, gt=0, le=3600)
    metrics_maxlen: int = Field(default=100_000, ge=100)
    metrics_port_base: int | None = Field(default=None, ge=1, le=65535)  # Prometheus ports per service
    # --- ops engineer additions (dressage up) ---
    workers: int = Field(default=2, ge=1, le=256)  # rollout-worker replicas started by `dressage up`
    stop_grace_s: float = Field(default=30.0, ge=0, le=3600)  # SIGTERM -> SIGKILL wait per service tier
    ready_timeout_s: float = Field(default=180.0, gt=0, le=3600)  # engine/proxy /health wait at start
    restart_max: int = Field(default=10, ge=0, le=10_000)  # `up --restart`: restarts per service before giving up
    # torch CPU threads (OMP_NUM_THREADS) per service started by `dressage up`, e.g. {trainer: 1}; unset = torch's default
    service_threads: dict[str, int] = Field(default_factory=dict)
    # niceness added to each named service started by `dressage up`, 0..19 (higher = yields the CPU sooner),
    # e.g. {eval-worker: 10}; unset = the supervisor's own. Only shares contended cores: idle ones are still used
    service_nice: dict[str, int] = Field(default_factory=dict)
    # Linux CPU scheduling policy per service started by `dressage up`: "batch" (SCHED_BATCH: never preempts
    # on wake-up) or "idle" (SCHED_IDLE: runs only on a core no normal task wants), e.g. {engine: idle};
    # unset = normal. Lets the rollout side yield a contended core to the trainer at once (docs/benchmarks.md).
    # Both rank the run's services against each other: `dressage up` keeps them in one session (docs/operations.md)
    service_sched: dict[str, Literal["batch", "idle"]] = Field(default_factory=dict)
    # true: `dressage up` forks the trainer, the engine and the eval worker on the CPU from one launcher that has
    # imported torch and transformers once (each starts about 4 s of CPU sooner, a restart too); a service on a
    # GPU is always started fresh. false: every service is a fresh interpreter (docs/operations.md)
    prefork: bool = True

    @field_validator("service_threads")
    @classmethod
    def _known_services(cls, value: dict[str, int]) -> dict[str, int]:
        return _per_service(value, 1, 1024, "threads")

    @field_validator("service_nice")
    @classmethod
    def _known_services_nice(cls, value: dict[str, int]) -> dict[str, int]:
        return _per_service(value, 0, 19, "nice")

    @field_validator("service_sched")
    @classmethod
    def _known_services_sched(cls, value: dict[str, str]) -> dict[str, str]:
        _check_service_names(value)
        return value


class DressageConfig(Section):
    redis: RedisConfig = Field(default_factory=RedisConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    prompt_buffer: PromptBufferConfig = Field(default_factory=PromptBufferConfig)
    pacing: PacingConfig = Field(default_factory=PacingConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    staleness: StalenessSection = Field(default_factory=StalenessSection)
    window_controller: WindowControllerConfig = Field(default_factory=WindowControllerConfig)
    collector: CollectorConfig = Field(default_factory=CollectorConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    ops: OpsConfig = Field(default_factory=OpsConfig)

    @model_validator(mode="after")
    def _controller_needs_a_window(self) -> DressageConfig:
        if self.window_controller.enabled and self.staleness.mode == "wait":
            raise ValueError("window_controller.enabled: the adaptive window sets staleness.keep_versions, which "
                             "staleness.mode=wait refuses (nothing is dropped there): disable one of them")
        return self

    @field_validator("redis")
    @classmethod
    def _password_policy(cls, value: RedisConfig) -> RedisConfig:
        if value.require_password:
            pw = value.secret() or ""
            if pw.strip().lower() in DEV_PASSWORDS:
                raise ValueError("a non-empty, non-default password is required (set REDIS_PASSWORD, "
                                 "or put it in REDIS_URL)")
        return value

    def keys(self) -> Keys:
        """Key names of this run; on a Redis Cluster the prefix is a hash tag (``shared.redisconn.run_prefix``)."""
        from shared.redisconn import run_prefix

        return Keys(run_prefix(self.redis.prefix, self.redis.url))


SECTIONS = tuple(DressageConfig.model_fields)


def _coerce_env(raw: str) -> Any:
    """Env values are YAML scalars/lists: "2" -> 2, "true" -> True, "null" -> None, "[a, b]" -> list."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _env_overrides(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    # Longest section names first so "prompt_buffer" wins over a hypothetical "prompt".
    for section in sorted(SECTIONS, key=len, reverse=True):
        head = f"{ENV_PREFIX}{section.upper()}_"
        for name, raw in env.items():
            if name.startswith(head):
                key = name[len(head):].lower()
                if key in DressageConfig.model_fields[section].annotation.model_fields:  # type: ignore[union-attr]  # every field is a Section class
                    out.setdefault(section, {})[key] = _coerce_env(raw)
    if "REDIS_URL" in env:
        out.setdefault("redis", {}).setdefault("url", env["REDIS_URL"])
    if "REDIS_PASSWORD" in env:
        out.setdefault("redis", {}).setdefault("password", env["REDIS_PASSWORD"])
    return out


def _describe(err: Any) -> str:
    key = ".".join(str(p) for p in err.get("loc", ()))
    ctx = err.get("ctx") or {}
    bounds = [f"{op} {ctx[k]}" for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if k in ctx]
    allowed = f" (allowed: {' and '.join(bounds)})" if bounds else ""
    secret = any(w in key for w in ("password", "api_key", "secret", "token"))
    value = err.get("input")
    # Secrets never reach logs; whole sections are not echoed either (they may hold one).
    got = "<redacted>" if secret or isinstance(value, (dict, list)) else repr(value)
    return f"{key}: {err.get('msg')}{allowed}; got {got}"


def read_yaml_mapping(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A YAML file holding a mapping (an empty file is an empty one); ConfigError naming the file otherwise."""
    p = Path(path)
    try:
        loaded = yaml.safe_load(p.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"{what} not found: {p}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {p} is not valid YAML: {exc}") from exc
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{what} {p} must be a mapping")
    return loaded or {}


def merge_layers(base: dict[str, Any], *layers: dict[str, Any]) -> dict[str, Any]:
    """``layers`` applied over ``base`` in order, section by section: a later layer's ``section.key``
    replaces the earlier one's, keys it does not name are kept. The one layering rule (file, env, experiment
    specs, test harnesses); ConfigError names a section of ``base`` that is not a mapping."""
    data = dict(base)
    for layer in layers:
        for section, values in layer.items():
            current = data.get(section) or {}
            if not isinstance(current, dict):
                raise ConfigError(f"{section}: must be a mapping")
            data[section] = {**current, **values}
    return data


def load_config(path: str | Path | None = None, env: dict[str, str] | None = None,
                overrides: dict[str, dict[str, Any]] | None = None) -> DressageConfig:
    """Read ``path`` (YAML; None = defaults), apply env and explicit overrides, validate."""
    env = dict(os.environ) if env is None else env
    base: dict[str, Any] = read_yaml_mapping(path) if path is not None else {}
    data = merge_layers(base, _env_overrides(env), overrides or {})
    try:
        cfg = DressageConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("invalid configuration: " + "; ".join(_describe(e) for e in exc.errors())) from exc
    from shared.hub import resolve_model_path  # local: no hub import unless a path needs it

    cfg.model.path = resolve_model_path(cfg.model.path)  # a model id -> its folder in the HF cache
    return cfg
