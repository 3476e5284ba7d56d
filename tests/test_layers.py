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
    # a front end reaching past the store's face (store.api), as the command line did before issue 29
    ("cli/listing.py", "from skip_harness.store import scan as _scan", "skip_harness.cli.listing -> skip_harness.store.scan"),
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


def _face_imports(root: Path):
    """{name: [module, ...]}: what each module outside skip_harness/store/ imports from the store's face."""
    import ast

    used: dict = {}
    for path in sorted((root / "skip_harness").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("skip_harness/store/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "skip_harness.store.api":
                for alias in node.names:
                    used.setdefault(alias.name, []).append(rel)
    return used


def test_the_store_face_is_what_the_front_ends_use():
    """Issue 29: store.api re-exports exactly the names the front ends import (none unused, none missing)
    and each is the object its defining module holds."""
    import importlib

    from skip_harness.store import api

    used = _face_imports(ROOT)
    assert sorted(api.__all__) == sorted(used), (set(api.__all__) ^ set(used))
    assert len(api.__all__) == len(set(api.__all__))
    for name in api.__all__:
        value = getattr(api, name)
        home = getattr(value, "__module__", None)
        if home and home.startswith("skip_harness.store."):
            assert getattr(importlib.import_module(home), value.__name__) is value, name


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
               "write_bytes", "write_text", "mmap", "lstat", "stat", "load"}
# Files outside the cache, opened by the code that owns them: (module, call) -> what the file is.
_NOT_THE_CACHE = {
    ("skip_harness/cli/export.py", "open"): "the export's own output file",
    ("skip_harness/cli/export.py", "stat"): "the export's own output file (its size, reported)",
    ("skip_harness/testing/store_tests.py", "stat"): "no file: `Storage.stat`, the storage protocol's tests calling it",
    ("skip_harness/demo/run.py", "open"): "the demo's metrics.jsonl",
    ("skip_harness/integrations/hydra.py", "write_text"): "a sweep job's failure record",
    ("skip_harness/integrations/hydra.py", "read_text"): "a sweep job's failure record",
    ("skip_harness/integrations/hydra_run.py", "open"): "the Hydra run directory's .run.lock (who holds it)",
    ("skip_harness/integrations/hydra_run.py", "iterdir"): "the Hydra run directory (an earlier run's files)",
    ("skip_harness/codec/torchsave.py", "load"): "torch.load of bytes already in memory (io.BytesIO)",
    ("skip_harness/cli/__init__.py", "open"): "os.devnull, stdout's new target once its reader closed the pipe",
    ("skip_harness/run/verdict.py", "write_text"): "the replay report, in the directory $SKIP_HARNESS_REPLAY_REPORT names",
    ("skip_harness/cli/replay.py", "read_text"): "the replay reports its run wrote, in the replay's temporary directory",
    ("skip_harness/run/machine.py", "open"): "/proc/cpuinfo: the CPU model stored beside a step's values",
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


# ---------------------------------------------------------------------------- who opens a namespace

_OPENERS = {"open_namespace", "open_store", "namespace_of"}
# Where a namespace may be opened: a command (cli/), a run's startup (every rank once: rank 0 when it
# locks, the others when they follow it), and a run reading a recording (run.recording): the recording,
# read-only, once per rank (rank 0 where it checks it -- and each candidate `replay_from=auto` checks --,
# the other ranks after its broadcast), and a replay_from run's own, opened once before its startup decides
# and handed to it. Everything else is handed the opened one.
_OPENED_AT = {"skip_harness/run/startup.py": 2, "skip_harness/run/recording.py": 3,
              # the packs' API, called as a command is (`pack` / `unpack` / bless): the namespace packed (read
              # only), the one a pack is restored into and the pack file read by unpack and by bless (its
              # backend claims it: store.registry.Backend.claims), each opened once by the call that works on it
              "skip_harness/store/pack.py": 4}


def _opener_calls(path: Path):
    import ast

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in _OPENERS:
                yield name, node.lineno


def _namespace_openings(root: Path):
    """What breaks 'one namespace, opened once and handed down': an opener called outside a command, the
    run's startup or its source (or more often there than allowed), and a namespace kept between calls
    by the opener's module."""
    import ast

    found = []
    for path in sorted((root / "skip_harness").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("skip_harness/cli/") or rel == "skip_harness/store/open.py":
            continue
        calls = list(_opener_calls(path))
        if len(calls) > _OPENED_AT.get(rel, 0):
            found += [f"{rel}:{line}: {name}(...)" for name, line in calls]
    tree = ast.parse((root / "skip_harness" / "store" / "open.py").read_text())
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            if isinstance(node.value, (ast.Dict, ast.Call)):
                found.append(f"skip_harness/store/open.py:{node.lineno}: a module-level cache ({ast.unparse(node)[:60]})")
        if isinstance(node, ast.FunctionDef) and node.name == "namespace_of":
            found.append(f"skip_harness/store/open.py:{node.lineno}: namespace_of (a namespace per call site)")
    return found


def test_a_namespace_is_opened_once_and_handed_down():
    """Issue 29: the scan, the cleanup, the step store, the follower take the namespace their run or command
    opened; none opens its own, and the opener keeps none (an object store's namespace holds the lease the
    run's writes check: it must be the one the startup locked)."""
    found = _namespace_openings(ROOT)
    assert not found, "a namespace opened where it should be handed down:\n" + "\n".join(found)
    # the check sees what it looks for: the commands open theirs
    assert sum(1 for p in (ROOT / "skip_harness" / "cli").rglob("*.py") for _ in _opener_calls(p)) >= 5


# ---------------------------------------------------------------------------- the store's bytes: through Storage

_OS_FILE_CALLS = {"open", "fdopen", "scandir", "listdir", "walk", "stat", "lstat", "fstat", "unlink", "remove",
                  "rename", "replace", "mkdir", "makedirs", "rmdir", "readlink", "symlink", "preadv", "pread",
                  "pwrite", "exists", "lexists", "isdir", "isfile", "islink", "getsize"}
_PATH_READERS = {"load", "check", "stored_fields", "sibling_meta"}     # store.payload_file: a file by its path
# Files that are not a namespace's, opened by the module that owns them: (module, call) -> what they are.
_NOT_A_NAMESPACE = {
    "skip_harness/store/payload_file.py": "a loose payload file named by its path (`show FILE` outside any namespace)",
    "skip_harness/store/verl_dump.py": "verl's own dump directory (import-verl's input), not the cache",
    "skip_harness/store/objstore/lease.py": "/proc: this host's boot id and whether a pid lives",
}


# Backends whose storage is a local file (the seam itself, as the POSIX backend's package is).
_BACKEND_FILES = {"skip_harness/store/packfile.py"}     # a pack file: read in place, written whole


def _file_access(path: Path):
    """Calls that reach a file by its path: builtin open, os.* / os.path.* file calls, payload_file's path readers."""
    import ast

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "open":
            yield "open", node.lineno
        elif isinstance(f, ast.Attribute):
            owner = ast.unparse(f.value)
            if owner in ("os", "os.path") and f.attr in _OS_FILE_CALLS:
                yield f"{owner}.{f.attr}", node.lineno
            elif owner == "payload_file" and f.attr in _PATH_READERS:
                yield f"payload_file.{f.attr}", node.lineno


def _store_file_access(root: Path):
    found = []
    for path in sorted((root / "skip_harness" / "store").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("skip_harness/store/posix/") or rel in _NOT_A_NAMESPACE or rel in _BACKEND_FILES:
            continue
        found += [f"{rel}:{line}: {name}(...)" for name, line in _file_access(path)]
    return found


def test_the_store_reaches_a_namespace_only_through_its_storage():
    """Issue 29: above the storage seam (every store module but the POSIX backend's), a namespace's files are
    read, listed and removed through `Storage` -- the index's removal, an older step's payloads, the
    namespaces of a directory included -- never by path with os.* or open()."""
    found = _store_file_access(ROOT)
    assert not found, "file access on cache paths above the storage seam:\n" + "\n".join(found)
    # the check sees what it looks for: the POSIX backend is made of it
    assert sum(1 for p in (ROOT / "skip_harness" / "store" / "posix").rglob("*.py") for _ in _file_access(p)) > 20


# ---------------------------------------------------------------------------- a step's status: one enum

_STATUS_TEXTS = {"complete", "unverified", "incomplete", "corrupt"}
# cli/view/ (the viewer: its pages and charts key colours by the status text) is another change's; the
# enum is a str, so those keys match it.
_STATUS_TEXT_ALLOWED = ("skip_harness/store/status.py", "skip_harness/cli/view/")


def _status_literals(root: Path):
    """String constants that are a step status, outside docstrings, in the package."""
    import ast

    found = []
    for path in sorted((root / "skip_harness").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(_STATUS_TEXT_ALLOWED):
            continue
        tree = ast.parse(path.read_text(), str(path))
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in _STATUS_TEXTS and id(node) not in docstrings:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    return found


def test_a_step_status_is_the_enum_not_a_string():
    """Issue 29: a step's status is `store.status.StepStatus` (a str-valued enum, like `Outcome`), never the
    string spelled out again: a typo'd status would compare unequal to every step without a word."""
    found = _status_literals(ROOT)
    assert not found, "a step status spelled as a string (use store.status.StepStatus):\n" + "\n".join(found)
    from skip_harness.store.status import STATUSES, StepStatus

    assert [str(s) for s in STATUSES] == ["complete", "unverified", "incomplete", "corrupt"]
    assert f"{StepStatus.CORRUPT}" == "corrupt" and StepStatus.COMPLETE == "complete"
    import json

    assert json.dumps({StepStatus.COMPLETE: [StepStatus.INCOMPLETE]}) == '{"complete": ["incomplete"]}'


# ---------------------------------------------------------------------------- scripts/: joined without sys.path

def _sys_path_uses(root: Path):
    """`sys.path` read or changed in scripts/ (a script finds what lies beside it because Python puts its
    directory first on its path; what scripts and tests share lives in scripts/, on the tests' path by
    pyproject.toml's pytest `pythonpath`)."""
    import ast

    found = []
    for path in sorted((root / "scripts").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "path" and ast.unparse(node.value) == "sys":
                found.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
    return found


def test_no_script_reaches_for_sys_path():
    """Issue 29 item 2: scripts/ imports its bench library, the S3 server and verl's CPU scaffolding as
    modules beside it, never by editing sys.path."""
    found = _sys_path_uses(ROOT)
    assert not found, "sys.path in scripts/:\n" + "\n".join(found)


# ---------------------------------------------------------------------------- one name per thing

def _class_homes(root: Path):
    """{class name: [module, ...]} over the package."""
    import ast

    homes: dict = {}
    for path in sorted((root / "skip_harness").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                homes.setdefault(node.name, []).append(path.relative_to(root).as_posix())
    return homes


def test_no_two_classes_share_a_name():
    """Issue 41: the viewer's namespace (cli/view/data.py `ViewedNamespace`) is not the store's `Namespace`, and
    the object store's lease (`NamespaceLease`) is not the buffer pool's `Lease`: one name, one thing."""
    shared = {name: where for name, where in _class_homes(ROOT).items() if len(where) > 1}
    assert not shared, shared
    assert "Namespace" in _class_homes(ROOT)          # the check sees what it looks for


def test_ruffs_per_file_ignores_name_files_that_exist():
    """Issue 41: a per-file ignore of a deleted module silences nothing and misleads the reader."""
    import tomllib

    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    missing = [p for p in ruff.get("per-file-ignores", {}) if not any(ROOT.glob(p))]
    assert not missing, missing


def _namespace_parameters(root: Path):
    """(module:line, parameter name) of every parameter typed as the store's `Namespace` in store/, cli/ and run/"""
    import ast

    found = []
    for sub in ("store", "cli", "run"):
        for path in sorted((root / "skip_harness" / sub).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                    for a in args:
                        if a.annotation is not None and ast.unparse(a.annotation).strip("'\"") in (
                                "Namespace", "Optional[Namespace]"):
                            found.append((f"{rel}:{node.lineno}", a.arg))
    return found


def test_the_stores_namespace_has_one_name_in_signatures():
    """Issue 41: the store's `Namespace` was `backend` in 13 signatures, `ns` in 25 and `namespace` in 8; in
    store/, cli/ and run/ it is `namespace`, or `<role>_namespace` where a function sees two (a run's own
    and its recording's)."""
    params = _namespace_parameters(ROOT)
    other = [f"{where}: {name}" for where, name in params
             if name != "namespace" and not name.endswith("_namespace")]
    assert not other, "a Namespace parameter not named `namespace`:\n" + "\n".join(other)
    assert len(params) > 30            # the check sees what it looks for


# ---------------------------------------------------------------------------- one module reads a recording

def _replay_from_readers(root: Path):
    """run/ modules that read `settings.replay_from` or import the recording's module, less those allowed:
    run/recording.py itself, the harness (it starts the run through it), the run's settings (validated when
    built: recording.check_replay_from) and the replay report (which names the key's value)."""
    import ast

    allowed_reads = {"recording.py", "verdict.py"}
    found = []
    for path in sorted((root / "skip_harness" / "run").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "replay_from" and path.name not in allowed_reads:
                found.append(f"run/{path.name}:{node.lineno}: .replay_from")
            if (isinstance(node, ast.ImportFrom) and node.module == "skip_harness.run.recording"
                    and path.name not in ("harness.py", "settings.py")):     # settings.py: its check, when built
                found.append(f"run/{path.name}:{node.lineno}: imports run.recording")
    return found


def test_replay_from_is_read_in_one_module():
    """Issue 41: replay_from lives in run/recording.py. The step runner serves steps from a StepSource
    (run/step_source.py) and never asks whether it is the run's own namespace or a recording; nothing else in
    run/ decides anything from the key."""
    found = _replay_from_readers(ROOT)
    assert not found, "replay_from read outside run/recording.py:\n" + "\n".join(found)
