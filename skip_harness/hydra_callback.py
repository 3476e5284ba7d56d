"""The Hydra callbacks under the name the README and conf/ use; they live in
:mod:`skip_harness.integrations.hydra`."""
from skip_harness.integrations.hydra import (  # noqa: F401  (re-exported)
    FAILURE_FILE, HydraStartupCallback, SweepReport, config_composed, note_config_composed, record_job_failure,
)

__all__ = ["FAILURE_FILE", "HydraStartupCallback", "SweepReport", "config_composed", "note_config_composed",
           "record_job_failure"]
