"""The package's layering (pyproject.toml's [tool.importlinter] contracts) and its public import names."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lint(cwd: Path, env=None) -> subprocess.CompletedProcess:
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_import_contracts_hold():
    proc = _lint(ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


@pytest.mark.parametrize("module, line, reported", [
    ("store/layout.py", "from skip_harness.run import stats", "skip_harness.store.layout -> skip_harness.run.stats"),
    ("store/scan.py", "from skip_harness.config import Cleanup as _C", "skip_harness.store.scan -> skip_harness.config"),
])
def test_a_bad_import_breaks_a_contract(tmp_path, module, line, reported):
    """The contracts can fail: the store importing the run, or config, is reported with the offending line."""
    shutil.copytree(ROOT / "skip_harness", tmp_path / "skip_harness", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / "skip_harness" / module
    path.write_text(path.read_text() + f"\n{line}  # noqa: E402\n")
    proc = _lint(tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert reported in proc.stdout


def _imports(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)


PUBLIC_NAMES = {  # module -> the names users import from it
    "skip_harness": ["SkipHarness", "HarnessCallback", "register_type", "NamespaceKey", "RunSummary", "StepRecord",
                     "Outcome"],
    "skip_harness.config": ["RolloutTQConfig", "register_configs", "settings_from", "rollout_tq_from"],
    "skip_harness.integrations.hydra": ["HydraStartupCallback", "SweepReport", "record_job_failure"],
    "skip_harness.integrations.trl": ["attach"],
    "skip_harness.demo.run": ["validate"],
    "skip_harness.cli": ["main"],
}


def test_the_public_import_names_still_work():
    """In-process (a subprocess would only add an interpreter start); the moved modules' old names are
    tests/test_public_face.py's."""
    import importlib

    for module, names in PUBLIC_NAMES.items():
        mod = importlib.import_module(module)
        missing = [n for n in names if not hasattr(mod, n)]
        assert not missing, (module, missing)


@pytest.mark.verl  # importing verl takes ~20 s
def test_the_verl_plug_in_imports():
    """Where verl is installed (extra [verl]; under CI=true a missing verl fails: tests/conftest.py)."""
    pytest.importorskip("verl", reason="extra [verl]: skip_harness.integrations.verl imports verl")
    proc = _imports("import skip_harness.integrations.verl\n")
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------- who opens files

_FILE_CALLS = {"open", "fdopen", "scandir", "listdir", "walk", "iterdir", "read_bytes", "read_text",
               "write_bytes", "write_text", "mmap", "lstat", "load"}
# Files outside the cache, opened by the code that owns them: (module, call) -> what the file is.
_NOT_THE_CACHE = {
    ("skip_harness/cli/export.py", "open"): "the export's own output file",
    ("skip_harness/demo/run.py", "open"): "the demo's metrics.jsonl",
    ("skip_harness/integrations/hydra.py", "write_text"): "a sweep job's failure record",
    ("skip_harness/integrations/hydra.py", "read_text"): "a sweep job's failure record",
    ("skip_harness/codec/torchsave.py", "load"): "torch.load of bytes already in memory (io.BytesIO)",
    ("skip_harness/cli/__init__.py", "open"): "os.devnull, stdout's new target once its reader closed the pipe",
    ("skip_harness/integrations/verl_tier.py", "open"): "verl's custom reward function's source file and the "
                                                        "model's config.json, digested for the second tier's keys",
}


def _file_calls(path: Path):
    import ast

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name not in _FILE_CALLS:
            continue
        if name == "load" and not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                                   and f.value.id in ("torch", "pickle")):
            continue            # json.loads and friends are not file calls; torch.load / pickle.load are
        yield name, node.lineno


def test_nothing_outside_the_store_opens_a_cache_file():
    """The storage seam, checked: outside skip_harness/store/ no module opens, lists, maps or loads a
    file, except the few files that are not the cache (each named above with what it is)."""
    found = []
    for path in sorted((ROOT / "skip_harness").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("skip_harness/store/"):
            continue
        for name, line in _file_calls(path):
            if (rel, name) not in _NOT_THE_CACHE:
                found.append(f"{rel}:{line}: {name}(...)")
    assert not found, "file access outside skip_harness/store/:\n" + "\n".join(found)
    # the check sees what it looks for: the store itself is full of it
    assert sum(1 for p in (ROOT / "skip_harness" / "store").rglob("*.py") for _ in _file_calls(p)) > 20
