"""Config schemas (dataclasses registered in Hydra's ConfigStore) and the checks across fields.

Type errors (a string where an int belongs, an unknown `action`, steps that are not ints) are caught by
OmegaConf while composing and name the key. Checks that involve several keys run when the config is
turned into these dataclasses (`__post_init__`) and raise :class:`ConfigError` naming the key.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from skip_harness.choices import Action, Cleanup, Compression, OnMismatch, ReplayCheck  # noqa: F401 - a leaf the store imports too
from skip_harness.errors import ConfigError
from skip_harness.nodes import MISSING, plain, select  # noqa: F401 - plain re-exported: the one conversion (a leaf the store imports too)
from skip_harness.store.urls import dump_dir_problem, is_url, local_path
from skip_harness.store.layout import NamespaceKey

TRAINER_MODES = ("sync", "colocate_async", "separate_async")
DUMP_DIR_ENV = "SKIP_HARNESS_DUMP_DIR"
# `skip-harness replay PACK -- COMMAND` sets these for the run it starts (docs/cli.md#replay): they replace
# the defaults of `skip.rollout_tq.replay_from` (null) and `replay_check` (warn); a value set otherwise wins.
REPLAY_FROM_ENV = "SKIP_HARNESS_REPLAY_FROM"
REPLAY_CHECK_ENV = "SKIP_HARNESS_REPLAY_CHECK"
ROLLOUT_TQ_KEY = "skip.rollout_tq"


# Values left out of the replay check by default: timings, throughput and memory (never bit-identical), and
# verl's validation metrics (`val-core/...`, `val-aux/...`): validation rollouts are never cached, a replay
# generates them again, so they reproduce only where generation is bit-identical.
DEFAULT_REPLAY_IGNORE = ("*_s", "*time*", "*timing*", "*throughput*", "*per_second*", "*memory*", "perf/*",
                         "*_ms", "*_sec*", "val-*")

# `skip.rollout_tq.replay_from`: serve another recording of the same batch, whatever its K and W.
REPLAY_FROM_KEY = "skip.rollout_tq.replay_from"
# The keys that say how a step's batch is split (K) and when it was generated (the mode), not what it holds:
# a recording may serve a run whose values for them differ (docs/configuration.md), and a replay at another
# K whose training side differs from the recording's only in them is the baseline of that K (run.baseline).
# verl's ppo_mini_batch_size is one: separate_async asserts train_batch_size = K x ppo_mini_batch_size.
BATCH_SPLIT_KEYS = ("trainer.v1.trainer_mode", "trainer.v1.separate_async.parameter_sync_step",
                    "parameter_sync_step",   # K as the verl plug-in records it
                    "actor_rollout_ref.actor.ppo_mini_batch_size", "critic.ppo_mini_batch_size",
                    # TRL: a generation call's size and how many micro-steps one serves (K = accumulation
                    # / steps_per_generation); the step's batch is the namespace's GBS, kept apart.
                    "trl.generation_batch_size", "trl.steps_per_generation")
# verl's workers: each mini-batch is split over trainer.nnodes x trainer.n_gpus_per_node of them. The verl
# plug-in's harness runs in verl's one driver process (its W is 1), so this product, read from the recorded
# training-side config, is the W its replay check compares at (run.shape).
WORKER_KEYS = ("trainer.nnodes", "trainer.n_gpus_per_node")
# The keys whose values change with W, how many ranks share a mini-batch: verl's worker counts (the rollout's
# follow the trainer's; Ray's GPU count), TRL's per-process batch (the step's batch / W). A replay at another W
# differs from the recording in them by design: the baseline of a W (run.baseline) may, and must hold this
# run's values for them; they explain no divergence of a rollout value. Matched by their last part, as
# BATCH_SPLIT_KEYS are.
SHARD_KEYS = WORKER_KEYS + ("actor_rollout_ref.rollout.nnodes", "actor_rollout_ref.rollout.n_gpus_per_node",
                            "ray_kwargs.ray_init.num_gpus", "trl.per_device_train_batch_size")
# Values that depend on a step's rollouts only (rewards, lengths), not on how they were trained on nor on
# how the step was split: the ones a replay at another K compares (the demo's, verl's and TRL's names;
# fnmatch, case-insensitive). verl merges its K sample calls' metrics into the step's (weighted means, max
# of maxima, min of minima: MetricsAggregator); TRL averages each metric over the step's K generation
# calls, so only its means over a call's rows are K-invariant (its min, max and std of a call are not).
ROLLOUT_VALUES = ("reward_mean", "response_len", "critic/score/*", "response_length/*", "prompt_length/*",
                  "reward", "rewards/*/mean", "completions/mean_length", "completions/clipped_ratio")
# `skip.rollout_tq.replay_weights`: the values naming the policy's parameters (`weights/{name}.{parameter}`, a
# digest each, run.weights): compared exactly, and only by a replay at the recording's K and W.
WEIGHTS_PREFIX = "weights/"


@dataclass
class KeyTolerance:
    """One `skip.rollout_tq.replay_tolerances` entry: what the keys its pattern matches are compared within,
    on any replay (`run.tolerance`)."""

    rtol: float = 0.0
    atol: float = 0.0


@dataclass
class RolloutTQConfig:
    """`skip.rollout_tq`: the rollout cache."""

    enable: bool = False
    dump_dir: Optional[str] = None
    steps: Optional[List[int]] = None
    action: Action = Action.cache
    cleanup: Cleanup = Cleanup.delete
    lock_timeout: float = 0.0
    # A run that reads a namespace another live run records (docs/design.md, "Many runs on one namespace"):
    # seconds to wait for a step that run has not committed yet before generating it itself (its own
    # rollouts, not written). 0: generate at once.
    follow_timeout: float = 0.0
    on_mismatch: OnMismatch = OnMismatch.error
    # Record torch/numpy/python global RNG states after each generation and restore them on a hit,
    # for trainers whose generation draws from the global generators (the demo does not need it).
    restore_rng: bool = False
    # Write cache files on a background thread (True) or inside `sample` (False, as verl does).
    async_write: bool = True
    # Mini-batches handed to the writer and not yet durable; at the bound `sample` waits (back-pressure).
    max_pending_writes: int = 2
    # Load and verify the next step's batches in the background while the trainer trains on this one.
    prefetch: bool = True
    # How payload bytes are stored: `none` (raw, full width) or `zstd` (integers narrowed losslessly, then zstd).
    compression: Compression = Compression.none
    # zstd level (1..22; negative levels are zstd's fast modes, down to -7); 1: the bench's choice.
    compression_level: int = 1
    # Compare a served step's reported values with the recorded ones (docs/replay_check.md): off, warn, error.
    replay_check: ReplayCheck = ReplayCheck.warn
    replay_rtol: float = 0.0
    replay_atol: float = 0.0
    # Value keys left out of the check (fnmatch patterns, case-insensitive): timings by default.
    replay_ignore: List[str] = field(default_factory=lambda: list(DEFAULT_REPLAY_IGNORE))
    # Record a digest of each of the policy's parameters after each step's update (`weights/...` values,
    # docs/replay_check.md#weights), compared exactly on a replay at the same K and W. Off: none computed.
    replay_weights: bool = False
    # Per-key tolerances: {key pattern (fnmatch, case-insensitive): {rtol, atol}}, the first match wins; a
    # key one names is compared within exactly those, on any replay (docs/replay_check.md).
    replay_tolerances: Dict[str, KeyTolerance] = field(default_factory=dict)
    # Serve from another recording of the same batch (a namespace path or URL, or `auto`), re-chunked to
    # this run's K and re-sharded to its ranks; read only. None: this run's own namespace.
    replay_from: Optional[str] = None
    # The second tier (docs/api.md#the-second-tier): store rewards and reference log-probs with a step and
    # serve them on a replay whose validity keys match (False: every phase runs, nothing is stored).
    tier: bool = True

    def __post_init__(self) -> None:
        key = ROLLOUT_TQ_KEY
        if self.replay_from is not None:
            text = str(self.replay_from).strip()
            if not text:
                raise ConfigError(REPLAY_FROM_KEY, "empty; set a namespace path or URL, `auto`, or null")
            if text != "auto" and dump_dir_problem(text) is not None:
                raise ConfigError(REPLAY_FROM_KEY, str(dump_dir_problem(text)).replace("dump_dir", "replay_from"))
            self.replay_from = text
        if self.steps is not None:
            for i, s in enumerate(self.steps):
                if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                    raise ConfigError(f"{key}.steps[{i}]", f"steps must be ints >= 0 or null, got {s!r}")
        if self.dump_dir is not None and dump_dir_problem(self.dump_dir) is not None:
            raise ConfigError(f"{key}.dump_dir", dump_dir_problem(self.dump_dir))
        if self.lock_timeout < 0:
            raise ConfigError(f"{key}.lock_timeout", f"must be >= 0 seconds, got {self.lock_timeout}")
        if not self.follow_timeout >= 0:
            raise ConfigError(f"{key}.follow_timeout", f"must be >= 0 seconds, got {self.follow_timeout}")
        if self.max_pending_writes < 1:
            raise ConfigError(f"{key}.max_pending_writes", f"must be >= 1, got {self.max_pending_writes}")
        if not -7 <= self.compression_level <= 22:
            raise ConfigError(f"{key}.compression_level", f"must be in -7..22 (zstd's levels), got {self.compression_level}")
        for name in ("replay_rtol", "replay_atol"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{key}.{name}", f"must be >= 0, got {getattr(self, name)}")
        self._check_tolerances()
        for name, enum in (
            ("action", Action), ("cleanup", Cleanup), ("on_mismatch", OnMismatch), ("compression", Compression),
            ("replay_check", ReplayCheck),
        ):
            value = getattr(self, name)
            if not isinstance(value, enum):
                try:
                    setattr(self, name, enum(value))
                except ValueError:
                    choices = ", ".join(e.value for e in enum)
                    raise ConfigError(f"{key}.{name}", f"unknown value {value!r}; expected one of {choices}") from None

    def _check_tolerances(self) -> None:
        where = f"{ROLLOUT_TQ_KEY}.replay_tolerances"
        if not isinstance(self.replay_tolerances, dict):
            raise ConfigError(where, f"must be a mapping {{key pattern: {{rtol, atol}}}}, got {self.replay_tolerances!r}")
        checked: Dict[str, KeyTolerance] = {}
        for pattern, entry in self.replay_tolerances.items():
            if not str(pattern).strip():
                raise ConfigError(where, "an empty key pattern")
            if isinstance(entry, dict):
                unknown = [k for k in entry if k not in ("rtol", "atol")]
                if unknown:
                    raise ConfigError(f"{where}.{pattern}.{unknown[0]}", "unknown key; expected rtol or atol")
                entry = KeyTolerance(**entry)
            if not isinstance(entry, KeyTolerance):
                raise ConfigError(f"{where}.{pattern}", f"must be a mapping {{rtol, atol}}, got {entry!r}")
            for name in ("rtol", "atol"):
                v = getattr(entry, name)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                    raise ConfigError(f"{where}.{pattern}.{name}", f"must be a number >= 0, got {v!r}")
            checked[str(pattern)] = entry
        self.replay_tolerances = checked

    def resolved_dump_dir(self) -> Union[Path, str]:
        """The cache root: the explicit key, else $SKIP_HARNESS_DUMP_DIR, else the user's cache dir. A
        local one is a Path; an object-store URL (`s3://bucket/prefix`) stays the string it is (a Path
        would fold its `//`): `store.open.open_dump_dir` opens either."""
        for value, name in ((self.dump_dir, f"{ROLLOUT_TQ_KEY}.dump_dir"), (os.environ.get(DUMP_DIR_ENV), DUMP_DIR_ENV)):
            if value and dump_dir_problem(value) is not None:
                raise ConfigError(name, dump_dir_problem(value))
            if value:
                return str(value) if is_url(value) else local_path(value)
        from platformdirs import user_cache_dir

        return Path(user_cache_dir("skip_harness")) / "rollouts"

    def wants_step(self, step: int) -> bool:
        return self.steps is None or step in self.steps


@dataclass
class SkipConfig:
    rollout_tq: RolloutTQConfig = field(default_factory=RolloutTQConfig)


def register_configs() -> None:
    """Register `skip.rollout_tq`'s schema in Hydra's ConfigStore (`skip: rollout_tq_schema` in a
    defaults list). Called explicitly by scripts, never on import; the demo adds its own with
    :func:`skip_harness.demo.config.register_demo_configs`."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(group="skip", name="rollout_tq_schema", node=RolloutTQConfig, package="skip.rollout_tq")


def _to_object(schema: type, cfg: Any, prefix: str) -> Any:
    """`cfg` (dict, DictConfig, dataclass instance or None) merged onto `schema` and turned into it.

    A key the schema does not have is a ConfigError naming it, with the closest known key (a typed
    node lets Hydra's `+key=value` add keys that OmegaConf would otherwise drop without a word).
    OmegaConf's own errors (wrong type) become one ConfigError naming the full key; the schemas' own
    checks already name theirs."""
    if cfg is not None and not dataclasses.is_dataclass(cfg):
        check_known_keys(schema, cfg, prefix)
    try:
        if dataclasses.is_dataclass(cfg) and isinstance(cfg, schema):
            base = OmegaConf.structured(cfg)
        else:
            base = OmegaConf.structured(schema)
            if cfg is not None:
                node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(
                    dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)  # type: ignore[arg-type]
                )
                base = OmegaConf.merge(base, node)
        obj = OmegaConf.to_object(base)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        full = f"{prefix}.{key}" if prefix and key else (prefix or key or "config")
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(full, reason) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(prefix or "config", f"not a mapping of settings: {exc}") from None
    return obj


def _fields_of(schema: type) -> dict:
    """{field name: its type} of a dataclass schema (the annotations resolved)."""
    hints = typing.get_type_hints(schema)
    return {f.name: hints.get(f.name) for f in dataclasses.fields(schema)}


def check_known_keys(schema: type, cfg: Any, prefix: str = "") -> None:
    """ConfigError for the first key of `cfg` (a mapping) that `schema` (a dataclass) does not have,
    nested schemas included: `skip.rollout_tq.actoin: unknown key; did you mean `action`?`."""
    if isinstance(cfg, DictConfig):
        items = [(str(k), cfg._get_node(k)) for k in cfg.keys()]
    elif isinstance(cfg, dict):
        items = [(str(k), v) for k, v in cfg.items()]
    else:
        return  # not a mapping: the merge reports it
    fields = _fields_of(schema)
    for name, value in items:
        full = f"{prefix}.{name}" if prefix else name
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.6)
            hint = f"did you mean `{close[0]}`?" if close else f"expected one of {', '.join(fields)}"
            where = f"`{prefix}`" if prefix else "the config"
            raise ConfigError(full, f"unknown key (not in {where}); {hint}")
        kind = fields[name]
        if dataclasses.is_dataclass(kind) and isinstance(value, (dict, DictConfig)):
            check_known_keys(kind, value, full)  # type: ignore[arg-type]


def settings_from(obj: Any) -> RolloutTQConfig:
    """`skip.rollout_tq` settings from a plain dict, an OmegaConf node, a RolloutTQConfig or None, with
    $SKIP_HARNESS_REPLAY_FROM and $SKIP_HARNESS_REPLAY_CHECK in place of their keys' defaults."""
    return with_replay_env(_to_object(RolloutTQConfig, obj, prefix=ROLLOUT_TQ_KEY))


def with_replay_env(settings: RolloutTQConfig) -> RolloutTQConfig:
    """`settings` with the environment `skip-harness replay` sets for its run: $SKIP_HARNESS_REPLAY_FROM
    where `replay_from` is null, $SKIP_HARNESS_REPLAY_CHECK where `replay_check` is its default (`warn`).
    A value the config sets otherwise wins, as an explicit `dump_dir` wins over $SKIP_HARNESS_DUMP_DIR
    (the replay's verdict then says the run did not replay as asked). A bad value is a ConfigError
    naming the variable."""
    changes: dict = {}
    text = os.environ.get(REPLAY_FROM_ENV, "").strip()
    if text and settings.replay_from is None:
        changes["replay_from"] = text
    check = os.environ.get(REPLAY_CHECK_ENV, "").strip()
    if check and settings.replay_check == RolloutTQConfig.replay_check:
        changes["replay_check"] = check
    if not changes:
        return settings
    try:
        return dataclasses.replace(settings, **changes)
    except ConfigError as exc:
        name = REPLAY_FROM_ENV if exc.key.endswith(".replay_from") else REPLAY_CHECK_ENV
        raise ConfigError(f"${name}", str(exc)[len(exc.key) + 2:]) from None


def as_node(cfg: Any) -> DictConfig:
    """A whole config (an OmegaConf node, a dict, a dataclass instance or None) as an OmegaConf node: the
    one conversion every reader of a config's dotted keys goes through."""
    if isinstance(cfg, DictConfig):
        return cfg
    if cfg is None:
        return OmegaConf.create({})
    try:
        return OmegaConf.structured(cfg) if dataclasses.is_dataclass(cfg) else OmegaConf.create(dict(cfg))
    except (TypeError, ValueError, OmegaConfBaseException) as exc:
        raise ConfigError("config", f"not a mapping of settings: {exc}") from None


def rollout_tq_from(cfg: Any) -> RolloutTQConfig:
    """The `skip.rollout_tq` node of any trainer's whole config as validated settings."""
    return settings_from(OmegaConf.select(as_node(cfg), ROLLOUT_TQ_KEY, default=None))


def check_batch_split(train_batch_size: int, K: int, world_size: int, mode: str = "separate_async") -> int:
    """The one batch-split check. `data.train_batch_size` is global: each sample on each rank takes
    train_batch_size / (K x W) prompts, which it returns; anything else is a ConfigError naming the key."""
    if train_batch_size % (K * world_size) == 0:
        return train_batch_size // (K * world_size)
    if world_size == 1:
        raise ConfigError(
            "data.train_batch_size",
            f"{train_batch_size} is not a multiple of K = trainer.v1.{mode}.parameter_sync_step = {K} "
            f"(each of the K sample calls of a step takes train_batch_size / K prompts)",
        )
    raise ConfigError(
        "data.train_batch_size",
        f"{train_batch_size} is not a multiple of K x W = {K} x {world_size} "
        f"(each sample on each rank takes train_batch_size / (K x W) prompts)",
    )


def select_key(cfg: Any, key: str, *, why: str) -> Any:
    """The value at dotted `key` of `cfg` (an OmegaConf node, a dict or a dataclass); ConfigError naming
    it when it is absent (`why` says who needs it)."""
    value = select(as_node(cfg), key, default=MISSING)
    if value is MISSING or value is None:
        raise ConfigError(key, f"missing; {why}")
    return value


def select_int(cfg: Any, key: str, *, minimum: int, why: str, required: bool = True) -> Optional[int]:
    """The int at dotted `key` (>= `minimum`); ConfigError naming the key when it is missing (unless not
    `required`: None) or not such an int."""
    value = select(as_node(cfg), key)
    if value is None:
        if required:
            raise ConfigError(key, f"missing; {why}")
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key, f"must be an int >= {minimum}, got {value!r}")
    return value


def k_for(mode: Any, parameter_sync_step: Optional[int]) -> int:
    """The one K rule, verl's V1 trainer's (trainer_base: ``trainer.v1.get(mode, {}).get("parameter_sync_step",
    1)``): a step's sample calls in trainer mode `mode` are that mode's own `trainer.v1.{mode}.parameter_sync_step`
    (`parameter_sync_step`; None: the mode's node has none, as sync and colocate_async), else 1. An unknown
    mode is a ConfigError naming `trainer.v1.trainer_mode`; a K < 1 names the mode's key."""
    if mode not in TRAINER_MODES:
        raise ConfigError("trainer.v1.trainer_mode", f"unknown mode {mode!r}; expected one of {', '.join(TRAINER_MODES)}")
    if parameter_sync_step is None:
        return 1
    if isinstance(parameter_sync_step, bool) or not isinstance(parameter_sync_step, int) or parameter_sync_step < 1:
        raise ConfigError(f"trainer.v1.{mode}.parameter_sync_step", f"must be an int >= 1, got {parameter_sync_step!r}")
    return parameter_sync_step


def k_of(cfg: Any) -> Tuple[str, int]:
    """(trainer mode, K) of a whole config with verl's key names (the demo's, verl's, `from_config`'s): the
    mode from `trainer.v1.trainer_mode` (missing: a ConfigError naming it), K by :func:`k_for`."""
    node = as_node(cfg)
    mode = select_key(node, "trainer.v1.trainer_mode", why="the rollout cache derives K from it")
    pss = select(node, f"trainer.v1.{mode}.parameter_sync_step") \
        if mode in TRAINER_MODES else None
    return mode, k_for(mode, pss)


NAMED_BY = "the rollout cache names its namespace with it"


def namespace_key_from_config(cfg: Any, K: Optional[int] = None) -> NamespaceKey:
    """The one builder of a verl-keyed config's namespace, W = 1 (the harness sets W at startup), with `K`
    when the caller has it (else :func:`k_of`). Every key is required: a missing `trainer.experiment_name`
    or `trainer.project_name` is a ConfigError naming it (verl's own composed config always has both; no
    default name is made up). GBS is `data.gen_batch_size` when set, else `data.train_batch_size`
    (verl #7051)."""
    node = as_node(cfg)
    if K is None:
        K = k_of(node)[1]
    train_batch_size = select_int(node, "data.train_batch_size", minimum=1, why=NAMED_BY)
    gen_batch_size = select_int(node, "data.gen_batch_size", minimum=1, why=NAMED_BY, required=False)
    gbs_key = "data.gen_batch_size" if gen_batch_size is not None else "data.train_batch_size"
    return checked_namespace(NamespaceKey(
        experiment_name=str(select_key(node, "trainer.experiment_name", why=NAMED_BY)),
        project_name=str(select_key(node, "trainer.project_name", why=NAMED_BY)),
        train_batch_size=gen_batch_size if gen_batch_size is not None else train_batch_size,
        n=select_int(node, "actor_rollout_ref.rollout.n", minimum=1, why=NAMED_BY),
        max_prompt_length=select_int(node, "data.max_prompt_length", minimum=0, why=NAMED_BY),
        max_response_length=select_int(node, "data.max_response_length", minimum=0, why=NAMED_BY),
        K=K,
    ), {"experiment_name": "trainer.experiment_name", "project_name": "trainer.project_name",
        "train_batch_size": gbs_key, "n": "actor_rollout_ref.rollout.n",
        "max_prompt_length": "data.max_prompt_length", "max_response_length": "data.max_response_length"})


def namespace_key_from(obj: Any) -> NamespaceKey:
    """A NamespaceKey from a plain dict / OmegaConf node / NamespaceKey, for trainers without verl keys:
    experiment_name, project_name, K and whichever shape values the trainer has."""
    if isinstance(obj, NamespaceKey):
        key = obj
    else:
        obj = plain(obj)
        if not isinstance(obj, dict):
            raise ConfigError("namespace", f"must be a dict or a NamespaceKey, got {type(obj).__name__}")
        fields = {f.name for f in dataclasses.fields(NamespaceKey)}
        unknown = sorted(set(obj) - fields)
        if unknown:
            raise ConfigError(f"namespace.{unknown[0]}", f"unknown key; expected some of {', '.join(sorted(fields))}")
        for name in ("experiment_name", "project_name"):
            if not obj.get(name):
                raise ConfigError(f"namespace.{name}", "missing; the rollout cache names its namespace with it")
        key = NamespaceKey(**obj)
    return checked_namespace(key)


def checked_namespace(key: NamespaceKey, keys: Optional[Dict[str, str]] = None) -> NamespaceKey:
    """The one check of a namespace key's fields, whichever builder made it: a name is a single path
    component (no '/', not starting with '.': `../../etc` would lay the namespace out of dump_dir), a
    shape value an int. A bad field is a ConfigError naming its config key (`keys`: field -> the key it
    came from; else `namespace.<field>`)."""
    for f in dataclasses.fields(NamespaceKey):
        value = getattr(key, f.name)
        where = (keys or {}).get(f.name, f"namespace.{f.name}")
        if f.name in ("experiment_name", "project_name"):
            if not isinstance(value, str) or not value or "/" in value or "\\" in value or value.startswith("."):
                raise ConfigError(where, f"must be a non-empty name without '/' not starting with '.', got {value!r}")
            continue
        if value is None and f.name not in ("K", "W"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if f.name in ("K", "W") else 0):
            raise ConfigError(where, f"must be an int >= {1 if f.name in ('K', 'W') else 0}, got {value!r}")
    return key
