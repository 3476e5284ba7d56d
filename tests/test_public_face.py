"""The package's public face: its version, its typed lazy names, the step outcome enum, the moved modules."""
from __future__ import annotations

import ast
import importlib
import importlib.metadata
import json
import sys
import warnings
from pathlib import Path

import pytest

import skip_harness
from skip_harness import Outcome
from skip_harness.run.stats import HIT, MISS, OFF, REPEAT

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_installed_metadata():
    assert skip_harness.__version__ == importlib.metadata.version("skip_harness")


def test_every_lazy_name_has_a_type_checking_import_of_the_same_object():
    tree = ast.parse((ROOT / "skip_harness" / "__init__.py").read_text())
    typed = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                typed.update({alias.name: imp.module for alias in imp.names})
    assert typed == skip_harness._PUBLIC  # what editors see is what the lazy import returns
    for name, module in skip_harness._PUBLIC.items():
        assert getattr(skip_harness, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        skip_harness.Nope  # noqa: B018


def test_outcome_is_a_string_valued_enum_that_old_comparisons_accept():
    assert (HIT, MISS, REPEAT, OFF) == (Outcome.HIT, Outcome.MISS, Outcome.REPEAT, Outcome.OFF)
    assert [o.value for o in Outcome] == ["hit", "miss", "repeat", "off"]
    assert Outcome.HIT == "hit" and "miss" == Outcome.MISS and Outcome.REPEAT in ("hit", "repeat")
    assert {"hit": 1}[Outcome.HIT] == 1 and {Outcome.OFF: 2}["off"] == 2  # same hash as the string
    assert str(Outcome.HIT) == f"{Outcome.HIT}" == "%s" % Outcome.HIT == "hit"  # log lines say "hit"
    assert json.dumps({"cache": Outcome.MISS}) == '{"cache": "miss"}'  # metrics.jsonl says "miss"
    assert Outcome("repeat") is Outcome.REPEAT


def test_outcome_of_a_harness_is_the_enum(tmp_path):
    import torch

    from skip_harness import SkipHarness

    class Loop:
        def sample(self, step):
            return {"x": torch.arange(4) + step}

    h = SkipHarness.create({"enable": True, "dump_dir": str(tmp_path)},
                           namespace={"experiment_name": "e", "project_name": "p", "K": 1})
    loop = Loop()
    h.wrap(loop, prepare_data=None)
    loop.sample(1)
    assert h.outcome(1) is Outcome.MISS and h.outcome(1) == "miss"
    assert h.outcome(2) is Outcome.OFF
    h.close()


@pytest.mark.parametrize("old, new, names", [
    ("skip_harness.harness", "skip_harness.run.harness", ["SkipHarness"]),
    ("skip_harness.callbacks", "skip_harness.run.callbacks", ["HarnessCallback", "CallbackDispatcher"]),
    ("skip_harness.hydra_callback", "skip_harness.integrations.hydra",
     ["HydraStartupCallback", "SweepReport", "record_job_failure"]),
])
def test_a_moved_module_imports_with_a_deprecation_warning_naming_the_new_place(old, new, names):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    target = importlib.import_module(new)
    for name in names:
        assert getattr(module, name) is getattr(target, name)
    assert set(names) <= set(dir(module))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError):
            module.not_there  # noqa: B018
