"""The pytest plugin: a recording kept as a test (docs/cli.md#replay).

Installed with the package (entry point `pytest11`, name `skip_harness`); without an install,
`pytest -p skip_harness.testing.pytest_plugin`. It adds

- the fixture `skip_harness_replay`: ``skip_harness_replay(pack, command)`` does what
  `skip-harness replay PACK -- COMMAND` does -- runs `command` (an argument list, or a string split as
  a shell would) serving every step from `pack` (a pack file or a namespace directory) with the replay
  check in error mode -- and fails the test with the verdict: the first diverging step and key, the
  recorded and the new value, and the training-side change that explains it. A step the run had to
  generate, a run that reported nothing, or a command that cannot start fail it too. It returns the
  verdict (`skip_harness.cli.replay.ReplayVerdict`) when the replay reproduced.
- the option ``--skip-harness-bless``: the fixture accepts the run's values as the recording's expected
  ones instead (written into the pack with the change that made them) and the test passes.

Nothing of skip_harness is imported until the fixture runs, so the plugin costs nothing in a session
that does not use it.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import pytest

BLESS_OPTION = "--skip-harness-bless"

log = logging.getLogger("skip_harness")


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("skip_harness", "skip_harness recordings as tests")
    group.addoption(BLESS_OPTION, action="store_true", default=False,
                    help="skip_harness_replay: accept each replay's values as its recording's expected ones "
                         "(with the training-side change that made them) instead of failing")


@pytest.fixture
def skip_harness_replay(request: Any) -> Callable[..., Any]:
    """``skip_harness_replay(pack, command, *, env=None, cwd=None)``: replay `command` from `pack`; fail
    the test with the verdict unless every step was served and reproduced (module doc)."""
    bless = bool(request.config.getoption(BLESS_OPTION))

    def replay(pack: Union[str, "os.PathLike[str]"], command: Union[str, Sequence[str]], *,
               env: Optional[Mapping[str, str]] = None, cwd: Union[str, "os.PathLike[str]", None] = None) -> Any:
        from skip_harness.cli._output import CliError
        from skip_harness.cli.replay import replay as run_replay

        try:
            verdict = run_replay(pack, command, bless=bless, env=env, cwd=cwd)
        except CliError as exc:
            pytest.fail(f"skip_harness_replay: {exc}", pytrace=False)
        if verdict.code != 0:
            hint = f"\n(an intended change? accept it: pytest {BLESS_OPTION})" if verdict.code == 1 else ""
            pytest.fail(f"skip_harness_replay {verdict.recording.path}: {verdict.line}{hint}", pytrace=False)
        if verdict.blessed is not None:
            log.warning("skip_harness_replay %s: %s", verdict.recording.path, verdict.line)
        return verdict

    return replay
