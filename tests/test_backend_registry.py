"""Backends from outside (issue 41): a storage backend registered by URL scheme -- in code, or by a package's
entry point `skip_harness.backends` -- passes the protocol's tests that ship in the package and serves a run
and a command through `dump_dir`, with no branch for it in skip_harness."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from dictstore_backend import SCHEME, DictBackend
from skip_harness.errors import ConfigError
from skip_harness.store.open import ObjectStoreBackend, PosixBackend, open_dump_dir
from skip_harness.store.registry import (ENTRY_POINT_GROUP, Backend, backend_for, register_backend, registered_schemes,
                                         unregister_backend)
from skip_harness.testing.store_tests import StoreTests

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def dict_backend():
    backend = register_backend(DictBackend())
    yield backend
    unregister_backend(backend)


class TestDictBackend(StoreTests):
    """The third-party backend inherits every protocol test by giving one fixture."""

    @pytest.fixture
    def dump_dir_url(self, dict_backend):
        return f"{SCHEME}://{uuid.uuid4().hex}/cache"


def test_our_own_backends_are_registered_like_any_other():
    assert {"file", "pack", "s3", "gs", "memory"} <= set(registered_schemes())
    assert isinstance(backend_for("file"), PosixBackend) and isinstance(backend_for("S3"), ObjectStoreBackend)


def test_a_scheme_nobody_serves_names_the_key_the_scheme_and_how_to_register_one():
    with pytest.raises(ConfigError) as exc:
        open_dump_dir(f"{SCHEME}://bucket/cache")          # not registered here (no fixture)
    msg = str(exc.value)
    assert msg.startswith("skip.rollout_tq.dump_dir: dict://bucket/cache: no storage backend serves dict://")
    assert ENTRY_POINT_GROUP in msg and "register_backend" in msg and "s3" in msg


def test_a_scheme_is_served_by_one_backend_unless_replaced(dict_backend):
    class Other(DictBackend):
        pass

    with pytest.raises(ValueError, match="'dict' is served by DictBackend already"):
        register_backend(Other())
    other = register_backend(Other(), replace=True)
    try:
        assert backend_for(SCHEME) is other
    finally:
        register_backend(dict_backend, replace=True)
    with pytest.raises(ValueError, match="names no URL scheme"):
        register_backend(type("NoScheme", (DictBackend,), {"schemes": ()})())
    with pytest.raises(TypeError, match="Backend"):
        register_backend(object())  # type: ignore[arg-type]
    assert issubclass(DictBackend, Backend)


def test_a_run_and_a_command_use_the_registered_backend_through_dump_dir(dict_backend, capsys):
    """The seam end to end: a harness with `dump_dir: dict://...` generates and commits, a second run is
    served every step from the dict, and `skip-harness ls` lists the namespace -- nothing on disk."""
    from skip_harness import SkipHarness
    from skip_harness.cli import main

    url = f"{SCHEME}://{uuid.uuid4().hex}/cache"

    def run():
        calls = []
        h = SkipHarness.create({"enable": True, "dump_dir": url},
                               namespace={"experiment_name": "e", "project_name": "p", "K": 1, "n": 2},
                               fingerprint={"model": "tiny"})

        class Trainer:
            def generate(self, prompts):
                calls.append(list(prompts))
                return {"ids": torch.tensor([[len(p)] * 3 for p in prompts])}

        t, state = Trainer(), {"step": 0}
        h.wrap(t, sample="generate", prepare_data=None, step_of=lambda: np.int64(state["step"]), first_step=0)
        for s in (0, 1):
            state["step"] = s
            assert t.generate([f"p{s}", "q"])["ids"].shape == (2, 3)
        h.close()
        return h, calls

    first, calls = run()
    assert [first.outcome(s) for s in (0, 1)] == ["miss", "miss"] and len(calls) == 2
    again, calls = run()
    assert [again.outcome(s) for s in (0, 1)] == ["hit", "hit"] and calls == []
    assert str(first.layout.root).startswith(url)
    assert main(["ls", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [len(ns["steps"]) for ns in doc["namespaces"]] == [2]


def _installed(tmp_path: Path, entry_points: str) -> dict:
    """A distribution on the path of a subprocess, as pip would leave one: its dist-info with entry_points.txt."""
    info = tmp_path / "site" / "thirdparty_backend-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-backend\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{entry_points}\n")
    path = os.pathsep.join([str(ROOT), str(tmp_path / "site"), str(ROOT / "tests")])
    return {**os.environ, "PYTHONPATH": path}


def test_a_package_registers_its_backend_by_entry_point(tmp_path):
    """Installed, not imported: the first `dict://` dump_dir loads it from the entry point group."""
    env = _installed(tmp_path, f"{SCHEME} = dictstore_backend:DictBackend")
    code = textwrap.dedent(f"""
        from skip_harness.store.open import open_dump_dir
        from skip_harness.store.registry import registered_schemes
        from skip_harness.testing.store_tests import LEAF, write_step
        from skip_harness.store.bufferpool import BufferPool
        assert "{SCHEME}" not in registered_schemes()
        url = "{SCHEME}://bucket/cache"
        write_step(open_dump_dir(url).namespace(LEAF), BufferPool(), 1)
        print(open_dump_dir(url).list_namespaces(), "{SCHEME}" in registered_schemes())
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['exp_proj/GBS8_N1_in16_out16_K2_W1'] True"


def test_an_entry_point_that_does_not_load_is_named_without_a_traceback(tmp_path):
    env = _installed(tmp_path, "broken = no_such_module:Backend\nodd = dictstore_backend:SCHEME")
    code = textwrap.dedent("""
        from skip_harness.errors import ConfigError
        from skip_harness.store.open import open_dump_dir
        for url in ("broken://b/c", "odd://b/c"):
            try:
                open_dump_dir(url)
            except ConfigError as exc:
                print(exc)
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    broken, odd = proc.stdout.strip().splitlines()
    assert broken == ("skip.rollout_tq.dump_dir: broken://b/c: entry point broken = no_such_module:Backend (group "
                      "'skip_harness.backends') failed to load: ModuleNotFoundError: No module named 'no_such_module'")
    assert odd.endswith("entry point odd = dictstore_backend:SCHEME (group 'skip_harness.backends') gives str, "
                        "not a skip_harness.store.registry.Backend")


def test_a_local_path_goes_to_the_backend_that_claims_it_and_its_holder_is_read_there(tmp_path):
    """Issue 41 item 5: store.open has no branch for the pack file or the POSIX lock's holder record; a
    registered backend claims a local layout (`Backend.claims`) and says who holds it (`Backend.holder`)."""
    from skip_harness.store.layout import Layout
    from skip_harness.store.open import open_namespace, read_lock_holder

    opened = []

    class Claiming(PosixBackend):
        schemes = ("claiming",)

        def claims(self, layout):
            return (Path(layout.root) / "CLAIMED").exists()

        def namespace(self, layout):
            opened.append(layout.root)
            return super().namespace(layout)

        def holder(self, layout):
            return "its holder"

    mine, other = Layout(tmp_path / "mine", K=1, W=1), Layout(tmp_path / "other", K=1, W=1)
    for layout in (mine, other):
        Path(layout.root).mkdir()
    (Path(mine.root) / "CLAIMED").touch()
    backend = register_backend(Claiming())
    try:
        open_namespace(mine), open_namespace(other)
        assert opened == [mine.root]                                  # the other: the `file` backend's
        assert read_lock_holder(mine) == "its holder" and read_lock_holder(other) is None
    finally:
        unregister_backend(backend)
    assert Backend.holder(backend, mine) is None and not Backend.claims(backend, mine)    # the defaults
