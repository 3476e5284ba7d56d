"""Observing the harness: a hook interface, a dispatcher, the logging consumer, and the Hydra callback.

In the shape of Hydra's callbacks: :class:`HarnessCallback` is a plain class of no-op methods that take
keyword arguments (and ``**kwargs``, so new arguments never break anyone); :class:`CallbackDispatcher`
calls start hooks in order and end hooks in reverse. :class:`LoggingCallback` is one consumer: it
turns events into the log lines users read. :class:`HydraStartupCallback` runs the startup scan and
cleanup from Hydra's ``on_job_start`` and holds the namespace lock until ``on_job_end``.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

log = logging.getLogger("skip_harness")


@dataclass(frozen=True)
class StepRecord:
    """What happened in one step, as the per-step log line reports it."""

    step: int
    kind: str  # hit | miss | repeat
    K: int
    source_step: Optional[int]
    bytes: int
    seconds: float  # generation seconds for a miss, load seconds for a hit or repeat
    unverified: bool = False


@dataclass(frozen=True)
class RunSummary:
    hits: int
    misses: int
    repeats: int
    off: int
    bytes_read: int
    bytes_written: int
    gen_s_spent: float
    gen_s_saved: float
    uncommitted: int


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


class HarnessCallback:
    """Hooks called by the harness. Override what you need; every method is a no-op."""

    def on_startup(self, *, namespace: str, startup: Any, **kwargs: Any) -> None:
        """After the startup scan and cleanup (``startup`` is a :class:`skip_harness.startup.StartupResult`)."""

    def on_step_start(self, *, step: int, decision: Any, **kwargs: Any) -> None:
        """When the harness has decided a step (``decision`` is a :class:`skip_harness.policy.Decision`)."""

    def on_serve(self, *, step: int, inner_index: int, source_step: int, bytes: int, seconds: float, **kwargs: Any) -> None:
        """A cached mini-batch was returned from ``sample``."""

    def on_write(self, *, step: int, inner_index: int, rank: int, bytes: int, seconds: float, **kwargs: Any) -> None:
        """A mini-batch (payload + meta) became durable."""

    def on_commit(self, *, step: int, bytes: int, **kwargs: Any) -> None:
        """A step's commit record was written."""

    def on_step_end(self, *, record: StepRecord, **kwargs: Any) -> None:
        """A step finished: served whole, or generated and committed."""

    def on_fault(self, *, path: str, reason: str, **kwargs: Any) -> None:
        """A fault was handled (failed write, failed verification, short step...)."""

    def on_end(self, *, summary: RunSummary, **kwargs: Any) -> None:
        """The harness closed."""


class CallbackDispatcher(HarnessCallback):
    """Calls every callback; start-like hooks in order, end-like hooks in reverse. A failing callback
    is logged and never breaks the run."""

    _REVERSED = {"on_step_end", "on_end"}

    def __init__(self, callbacks: Sequence[HarnessCallback] = ()):
        self.callbacks: List[HarnessCallback] = list(callbacks)

    def _notify(self, name: str, **kwargs: Any) -> None:
        order = reversed(self.callbacks) if name in self._REVERSED else self.callbacks
        for cb in order:
            try:
                getattr(cb, name)(**kwargs)
            except Exception:  # a broken observer must not break training
                log.exception("skip_harness callback %s.%s failed", type(cb).__name__, name)

    def on_startup(self, **kwargs: Any) -> None:
        self._notify("on_startup", **kwargs)

    def on_step_start(self, **kwargs: Any) -> None:
        self._notify("on_step_start", **kwargs)

    def on_serve(self, **kwargs: Any) -> None:
        self._notify("on_serve", **kwargs)

    def on_write(self, **kwargs: Any) -> None:
        self._notify("on_write", **kwargs)

    def on_commit(self, **kwargs: Any) -> None:
        self._notify("on_commit", **kwargs)

    def on_step_end(self, **kwargs: Any) -> None:
        self._notify("on_step_end", **kwargs)

    def on_fault(self, **kwargs: Any) -> None:
        self._notify("on_fault", **kwargs)

    def on_end(self, **kwargs: Any) -> None:
        self._notify("on_end", **kwargs)


class LoggingCallback(HarnessCallback):
    """Turns harness events into log lines under the ``skip_harness`` logger.

    Rank 0 speaks for the run (INFO); faults are WARNINGs from whichever rank met them.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, logger: Optional[logging.Logger] = None):
        self.rank = rank
        self.world_size = world_size
        self.log = logger or log

    def _info(self, msg: str, *args: Any) -> None:
        if self.rank == 0:
            self.log.info(msg, *args)

    def on_startup(self, *, namespace: str, startup: Any, **kwargs: Any) -> None:
        if not kwargs.get("quiet", False):
            self._info("%s", startup.describe())

    def on_step_end(self, *, record: StepRecord, **kwargs: Any) -> None:
        if record.kind == "repeat":
            what = f"repeat (served step {record.source_step})"
        elif record.kind == "hit" and record.unverified:
            what = "hit (unverified: no commit record)"
        else:
            what = record.kind
        verb = "generated" if record.kind == "miss" else "loaded"
        self._info(
            "step %d: %s, K=%d, %s %s in %.2fs",
            record.step, what, record.K, verb, human_bytes(record.bytes), record.seconds,
        )

    def on_fault(self, *, path: str, reason: str, **kwargs: Any) -> None:
        prefix = f"[rank {self.rank}] " if self.world_size > 1 else ""
        self.log.warning("%s%s: %s", prefix, path, reason)

    def on_end(self, *, summary: RunSummary, **kwargs: Any) -> None:
        self._info(
            "rollout cache summary: %d hits, %d repeats, %d misses, %d uncached; read %s, wrote %s; "
            "generation %.1fs spent, %.1fs saved%s",
            summary.hits, summary.repeats, summary.misses, summary.off,
            human_bytes(summary.bytes_read), human_bytes(summary.bytes_written),
            summary.gen_s_spent, summary.gen_s_saved,
            f"; {summary.uncommitted} steps left uncommitted" if summary.uncommitted else "",
        )


def _rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


def _world_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


try:  # Hydra is a dependency, but keep the hook interface importable without it.
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover
    _HydraCallback = object  # type: ignore[misc,assignment]


class HydraStartupCallback(_HydraCallback):  # type: ignore[misc]
    """Hydra callback: take the namespace lock, scan and clean before the task function runs.

    Configured in ``conf/config.yaml`` under ``hydra.callbacks``. Only rank 0 (``RANK`` unset or 0)
    acts. An exception in a Hydra callback only becomes a warning, so this callback never raises:
    when it cannot do the startup (bad config, lock held) it leaves it to the harness, which runs in
    the task function and stops the run with a clear message.
    """

    def __init__(self) -> None:
        self._held: Dict[int, Any] = {}

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        from .config import rollout_tq_from, namespace_key_from_config
        from .startup import prepare_namespace

        if _rank_from_env() != 0:
            return
        try:
            settings = rollout_tq_from(config)
            if not settings.enable:
                return
            key = namespace_key_from_config(config, _world_from_env())
            layout = key.layout(settings.resolved_dump_dir())
            result = prepare_namespace(layout, settings, timeout=0.0)
        except Exception as exc:  # the harness repeats the startup and reports properly
            log.debug("skip_harness startup deferred to the harness: %s", exc)
            return
        self._held[id(config)] = result
        report = LoggingCallback()  # the same lines the harness logs when it does the startup itself
        for path, reason in result.faults():
            report.on_fault(path=path, reason=reason)
        report.on_startup(namespace=str(layout.root), startup=result)

    def on_job_end(self, config: Any, **kwargs: Any) -> None:
        result = self._held.pop(id(config), None)
        if result is not None:
            result.release()
