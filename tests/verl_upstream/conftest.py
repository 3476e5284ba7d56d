"""verl's own tests/utils/test_utils_skip.py (verl v0.9.0; byte-identical to main 1dda039, whose
verl/utils/skip/ equals verl 0.9.1's), kept as verl wrote it, licence header included.

It is run by tests/test_verl_upstream.py in a subprocess with VERL_USE_EXTERNAL_MODULES naming the
plug-in, and is not collected by a plain `pytest` run (tests/conftest.py ignores this folder unless
SKIP_HARNESS_VERL_UPSTREAM=1).
"""
import os

if os.environ.get("SKIP_HARNESS_VERL_UPSTREAM") != "1":
    collect_ignore = ["test_utils_skip.py"]


def pytest_report_header(config):
    if os.environ.get("SKIP_HARNESS_VERL_UPSTREAM") != "1":
        return None
    from verl.utils.skip.base_skip import SKIP_REGISTRY

    return "verl skip registry: " + ", ".join(f"{k}={v.__module__}.{v.__qualname__}" for k, v in sorted(SKIP_REGISTRY.items()))
