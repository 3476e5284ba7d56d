"""Observing the harness: a hook interface, a dispatcher and the logging consumer.

In the shape of Hydra's callbacks: :class:`HarnessCallback` is a plain class of no-op methods that take
keyword arguments (and ``**kwargs``, so new arguments never break anyone); :class:`CallbackDispatcher`
calls start hooks in order and end hooks in reverse. :class:`LoggingCallback` is one consumer: it
turns events into the log lines users read. Every hook runs on the trainer's thread, in step order.
The Hydra callback lives in :mod:`skip_harness.integrations.hydra`.
"""
from __future__ import annotations

import logging
from typing import Any, List, Optional, Sequence

from skip_harness.run.stats import HIT, MISS, REPEAT, RunSummary, StepRecord
from skip_harness.units import human_bytes

log = logging.getLogger("skip_harness")


class HarnessCallback:
    """Hooks called by the harness. Override what you need; every method is a no-op."""

    def on_startup(self, *, namespace: str, startup: Any, **kwargs: Any) -> None:
        """After the startup scan and cleanup (``startup`` is a :class:`skip_harness.run.startup.StartupResult`;
        ``quiet`` is True when a Hydra callback already reported this startup)."""

    def on_step_start(self, *, step: int, decision: Any, **kwargs: Any) -> None:
        """When the harness has decided a step (``decision`` is a :class:`skip_harness.run.decision.Decision`)."""

    def on_serve(self, *, step: int, inner_index: int, source_step: int, bytes: int, seconds: float, **kwargs: Any) -> None:
        """A cached mini-batch was returned from ``sample``."""

    def on_write(self, *, step: int, inner_index: int, rank: int, bytes: int, seconds: float, **kwargs: Any) -> None:
        """A mini-batch (payload + meta) became durable."""

    def on_commit(self, *, step: int, bytes: int, **kwargs: Any) -> None:
        """A step's commit record was written (every rank's files are durable)."""

    def on_step_end(self, *, record: StepRecord, **kwargs: Any) -> None:
        """A step finished: served whole, generated (committed or not: ``record.committed``), or uncached."""

    def on_fault(self, *, path: str, reason: str, **kwargs: Any) -> None:
        """A fault was handled (failed write, failed verification, short step...)."""

    def on_values(self, *, step: int, outcome: str, values: Any, **kwargs: Any) -> None:
        """The trainer reported what `step` produced (``SkipHarness.observe``; ``values`` as given, numbers or
        not; ``outcome``: hit, miss or repeat), before the replay check compares them."""

    def on_replay_divergence(self, *, step: int, key: str, recorded: float, now: float, **kwargs: Any) -> None:
        """A served step's reported value differed from the recorded one: the replay's first divergence
        (``divergence`` is a :class:`skip_harness.run.replay_check.Divergence`; ``config_changes`` the
        training-side keys whose values differ from the recorded run's, as (key, recorded, now); ``stopping``
        True when ``replay_check=error`` raises ReplayDivergedError right after)."""

    def on_phase(self, *, step: int, phase: str, served: bool, seconds: float, saved: float, **kwargs: Any) -> None:
        """A second-tier phase (`reward`, `reference`, ...: run.tier) of a step was served from the cache
        (``saved``: the seconds it cost when recorded) or run (``seconds``; ``reason``: why a served step's
        phase ran again, '' otherwise; ``inner_index``: which call of the step)."""

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

    def on_values(self, **kwargs: Any) -> None:
        self._notify("on_values", **kwargs)

    def on_replay_divergence(self, **kwargs: Any) -> None:
        self._notify("on_replay_divergence", **kwargs)

    def on_phase(self, **kwargs: Any) -> None:
        self._notify("on_phase", **kwargs)

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
        self.namespace: Optional[str] = None  # named again in the summary line

    def _info(self, msg: str, *args: Any) -> None:
        if self.rank == 0:
            self.log.info(msg, *args)

    def on_startup(self, *, namespace: str, startup: Any, **kwargs: Any) -> None:
        self.namespace = namespace
        if kwargs.get("quiet", False) or self.rank != 0 or startup is None:
            return
        report = startup.report
        note = getattr(report, "index_note", None)
        if note:  # a brand-new namespace has no index yet: nothing is wrong, nothing to say
            (self.log.info if report.steps else self.log.debug)("rollout cache %s: %s", namespace, note)
        if getattr(startup, "read_only", False) and not getattr(startup, "reader", False) \
                and not any(s.servable for s in report.steps):
            self.log.warning("rollout cache %s is read-only (%s) and holds no complete step: nothing will be "
                             "cached, every step is generated", namespace, startup.read_only_reason)
            return
        self.log.info("%s", startup.describe())

    def on_step_end(self, *, record: StepRecord, **kwargs: Any) -> None:
        if self.rank == 0 and self.log.isEnabledFor(logging.INFO):    # the line is not built for nobody
            self.log.info("%s", describe_step(record))

    def on_fault(self, *, path: str, reason: str, **kwargs: Any) -> None:
        prefix = f"[rank {self.rank}] " if self.world_size > 1 else ""
        self.log.warning("%s%s: %s", prefix, path, reason)

    def on_replay_divergence(self, *, step: int, key: str, recorded: float, now: float, **kwargs: Any) -> None:
        if kwargs.get("stopping"):   # replay_check=error: the ReplayDivergedError raised next says it, once
            return
        if self.rank == 0:
            divergence = kwargs.get("divergence")
            self.log.warning("%s", divergence.describe() if divergence is not None
                             else f"replay diverged at step {step}: {key} {recorded} recorded, {now} now")

    def on_end(self, *, summary: RunSummary, **kwargs: Any) -> None:
        self._info("%s", describe_summary(summary, self.namespace, self.world_size))


def describe_step(r: StepRecord) -> str:
    """The per-step line: `step 3: miss, K=2, generated 1.2 MiB in 0.51s, committed`."""
    if r.kind == REPEAT:
        return f"step {r.step}: repeat (served step {r.source_step}), K={r.K}, loaded {human_bytes(r.bytes)} in {r.load_s:.2f}s"
    if r.kind == HIT:
        what = "hit (unverified: no commit record)" if r.unverified else "hit"
        line = f"step {r.step}: {what}, K={r.K}, loaded {human_bytes(r.bytes)} in {r.load_s:.2f}s"
        return f"{line}, served {r.served_from}" if r.served_from else line
    if r.kind == MISS:
        what = "miss (inputs differed from the recorded ones)" if r.regenerated else "miss"
        done = "committed" if r.committed else f"not committed ({r.reason})"
        line = f"step {r.step}: {what}, K={r.K}, generated {human_bytes(r.bytes)} in {r.gen_s:.2f}s, {done}"
        return f"{line}; {r.compared}" if r.compared else line
    return f"step {r.step}: uncached ({r.reason})" if r.reason else f"step {r.step}: uncached"


def describe_summary(s: RunSummary, namespace: Optional[str] = None, world_size: int = 1) -> str:
    """The summary line; its counts are the sums of the per-step lines. Bytes are the steps' sizes on
    disk (every rank's files and the commit record, as `skip-harness ls` shows them); `namespace`, the
    cache's directory, ends the line."""
    line = (
        f"rollout cache summary: {s.steps} {_plural(s.steps, 'step')}: {s.hits} {_plural(s.hits, 'hit')}, "
        f"{s.repeats} {_plural(s.repeats, 'repeat')}, {s.misses} {_plural(s.misses, 'miss', 'misses')} "
        f"({s.committed} committed, {s.uncommitted} not"
    )
    if s.uncommitted_reasons:
        line += ": " + ", ".join(f"{n} {why}" for why, n in s.uncommitted_reasons.items())
    ranks = f" (all {world_size} ranks' files)" if world_size > 1 else ""
    line += (
        f"), {s.off} uncached; read {human_bytes(s.bytes_read)}, wrote {human_bytes(s.bytes_written)}{ranks}"
        + (f" ({human_bytes(s.bytes_not_written)} generated "
           f"{'and compared' if getattr(s, 'compared', '') else 'into a read-only cache'}, not written)"
           if s.bytes_not_written else "")
        + "; "
        f"generation {s.gen_s_spent:.1f}s spent, {s.gen_s_saved:.1f}s saved; loading {s.load_s:.1f}s"
    )
    for name, t in getattr(s, "phases", {}).items():      # the second tier's phases (run.tier)
        line += f"; {name} {t.spent_s:.1f}s spent, {t.saved_s:.1f}s saved"
    if getattr(s, "compared", ""):               # action=compare: the generation side's drift
        line += f"; {s.compared}"
    replay = getattr(s, "replay_line", "")
    if replay:
        line += f"; {replay}"
    return line + (f"; cache in {namespace}" if namespace else "")


def _plural(n: int, word: str, plural: str = "") -> str:
    return word if n == 1 else plural or word + "s"
