"""verl's metrics for each step, fed to the harness's replay check (docs/replay_check.md).

verl's trainer reports a step's metrics once, through its own tracker:
``self.logger.log(data=metrics, step=self.global_steps)`` (``verl.utils.tracking.Tracking``), after the
step trained and before ``SkipManager.set_step`` moves on -- the console, file, wandb ... backends all
hear it there, whatever ``trainer.logger`` names. :func:`install` wraps ``Tracking.log`` in memory
(verl's files are not touched; the original is kept and :func:`uninstall` puts it back; a ``Tracking.log``
taking other parameters is refused first, :data:`verl_patches.PATCHES`): verl's own
``log`` runs first, unchanged, then the metrics go to every live verl rollout cache
(``SkipHarness.observe(step, **metrics)``): recorded with a generated step, compared on a served one.
A ``replay_check=error`` divergence is raised from there, after verl logged the step, and stops verl's
trainer; any other failure of ours is logged and never breaks verl's logging.

The training-side config recorded with the values is verl's whole config less the generation
fingerprint's keys and the cache's own nodes (``skip``, ``skip_harness``), flattened
(``actor_rollout_ref.actor.optim.lr``), so a divergence names the verl keys that changed.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional

from skip_harness.errors import ReplayDivergedError
from skip_harness.integrations import verl_live, verl_patches

log = logging.getLogger("skip_harness")

_original: Optional[Callable[..., Any]] = None


def training_config_of(skip: Any) -> dict:
    """The training side of verl's config for the plug-in instance `skip` (its `global_config`, less the
    fingerprint's keys)."""
    from skip_harness.run.training import training_side

    plan = getattr(skip, "plan", None)
    keys = list((plan.fingerprint if plan is not None else {}) or {})
    return training_side(skip.global_config, keys)


def feed(data: Any, step: Any, live: Iterable[Any]) -> None:
    """Hand verl's metrics of `step` to every live plug-in instance's harness."""
    try:
        step = int(step)
        values = dict(data)
    except (TypeError, ValueError):
        return
    for skip in live:
        harness = getattr(skip, "harness", None)
        if harness is None:
            continue
        try:
            if not getattr(skip, "_skip_harness_config_set", False):
                skip._skip_harness_config_set = True
                harness.set_training_config(training_config_of(skip))
            harness.observe(step, **values)
        except ReplayDivergedError:
            raise
        except Exception:  # noqa: BLE001 - the replay check must never break verl's logging
            log.exception("skip_harness: recording verl's metrics of step %s failed", step)
        finally:
            try:
                skip.step_logged(step)   # the run's last cached step: the harness closes now
            except Exception:  # noqa: BLE001 - never break verl's logging
                log.exception("skip_harness: closing the verl rollout cache after step %s failed", step)


def install(live: Callable[[], Iterable[Any]]) -> None:
    """(Run when the plug-in imports this module.) Wrap ``verl.utils.tracking.Tracking.log`` (once) so each step's metrics reach `live()`'s harnesses."""
    global _original
    from verl.utils.tracking import Tracking

    if _original is not None:
        return
    from verl import __version__

    verl_patches.check_tracking_log(Tracking, __version__)   # the wrapper passes data, step, backend
    original = Tracking.log

    def log_and_observe(self: Any, data: Any, step: Any, backend: Any = None) -> Any:
        out = original(self, data=data, step=step, backend=backend)
        feed(data, step, live())
        return out

    log_and_observe.__wrapped__ = original  # type: ignore[attr-defined]
    _original = original
    Tracking.log = log_and_observe  # type: ignore[method-assign]


def uninstall() -> None:
    """Give ``Tracking.log`` back its own method."""
    global _original
    if _original is None:
        return
    from verl.utils.tracking import Tracking

    Tracking.log = _original  # type: ignore[method-assign]
    _original = None


install(verl_live.instances)   # imported by the plug-in (one line at its end): wired when verl loads it

__all__ = ["feed", "install", "training_config_of", "uninstall"]
