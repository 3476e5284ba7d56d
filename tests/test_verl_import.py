"""import-verl on caches written by verl's OWN skip code, then served by the plug-in in verl's trainer code.

verl writes them here: its ``RolloutTqSkip`` (installed 0.9.x: ``{step}/0/tq_batch.pt`` for K = 1,
``{step}/{i}/tq_batch.pt`` for K = 2), the same class as verl main had it between #6897 and #7032
(``{step}/tq_batch.pt``; tests/verl_upstream/rollout_skip_pr6897.py, verl's file at 9c9a1bfcf) and its
V0 ``RolloutSkip`` (``{step}/gen_batch.dp``, a pickled DataProto), each driven through verl's own
decorators. The Ray + TransferQueue start is shared with test_verl_plugin.py when both run (it is
idempotent in one process).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

import torch  # noqa: E402
import verl_rig as rig  # noqa: E402

from conftest import REPO  # noqa: E402
from skip_harness.store.open import open_namespace, open_store
from skip_harness.cli import main  # noqa: E402
from skip_harness.store.layout import NamespaceKey  # noqa: E402
from skip_harness.store.scan import scan_namespace  # noqa: E402
from skip_harness.store.stepstore import StepStore  # noqa: E402

pytestmark = pytest.mark.verl


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import skip_harness.integrations.verl  # noqa: F401 - registers the plug-in's rollout_tq class

    yield rig.start(rig.compose(str(tmp_path_factory.mktemp("boot"))))
    rig.clear_queue()


@contextlib.contextmanager
def verls_own(role: str, cls: type):
    """verl's registry with `cls` for `role` (as verl has it without the plug-in), restored afterwards."""
    from verl.utils.skip.base_skip import SKIP_REGISTRY

    saved = dict(SKIP_REGISTRY)
    SKIP_REGISTRY[role] = cls
    try:
        yield
    finally:
        SKIP_REGISTRY.clear()
        SKIP_REGISTRY.update(saved)


def pr6897_rollout_tq() -> type:
    """verl's RolloutTqSkip as verl main had it at #6897 (flat {step}/tq_batch.pt); importing the file
    registers its classes, so the registry is put back as it was."""
    from verl.utils.skip.base_skip import SKIP_REGISTRY

    saved = dict(SKIP_REGISTRY)
    spec = importlib.util.spec_from_file_location("verl_rollout_skip_pr6897", REPO / "tests" / "verl_upstream" / "rollout_skip_pr6897.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    SKIP_REGISTRY.clear()
    SKIP_REGISTRY.update(saved)
    return module.RolloutTqSkip


def import_verl(capsys, source: Path, dump: Path):
    capsys.readouterr()  # verl's skip classes print to stdout
    code = main(["import-verl", str(source), str(dump), "--trust", "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


@pytest.mark.parametrize("layout", ["0.9.1 K=1 {step}/0/", "0.9.1 K=2 {step}/{i}/", "#6897 K=1 {step}/"])
def test_a_cache_verl_wrote_is_imported_then_served(cluster, tmp_path, capsys, layout):
    from verl.utils.skip.rollout_skip import RolloutTqSkip

    K = 2 if "K=2" in layout else 1
    verl_class = pr6897_rollout_tq() if "#6897" in layout else RolloutTqSkip
    verl_dir, dump = tmp_path / "verl", tmp_path / "ours"
    # the #6897 class reads data.gen_batch_size without falling back (verl #7051 fixed that): set it
    extra = ["data.gen_batch_size=4"] if "#6897" in layout else []
    with verls_own("rollout_tq", verl_class):
        recorded = rig.run_steps(rig.compose(str(verl_dir), K=K, extra=extra), buffer="async", salt=1, steps=(1, 2))
    assert recorded.train_generations == 2
    verl_ns = verl_dir / f"{rig.EXPERIMENT}_{rig.PROJECT}" / "GBS4_N2_in8_out6"
    want = {"0.9.1 K=1 {step}/0/": ["0/tq_batch.pt"], "0.9.1 K=2 {step}/{i}/": ["0/tq_batch.pt", "1/tq_batch.pt"],
            "#6897 K=1 {step}/": ["tq_batch.pt"]}[layout]
    assert sorted(p.relative_to(verl_ns / "1").as_posix() for p in (verl_ns / "1").rglob("tq_batch.pt")) == want

    code, doc, err = import_verl(capsys, verl_dir, dump)
    assert code == 0, err
    assert sorted(d["step"] for d in doc["converted"]) == [1, 2] and doc["failed"] == []
    assert {d["trajectories"] for d in doc["converted"]} == {8}

    served = rig.run_steps(rig.compose(str(dump), K=K, extra=extra), buffer="async", salt=2, steps=(1, 2))
    assert served.outcomes == {1: "hit", 2: "hit"} and served.train_generations == 0
    assert [rig.comparable(s) for s in served.sampled] == [rig.comparable(s) for s in recorded.sampled]
    assert all(rig.uid_field_matches_keys(s) for s in served.sampled)


def test_a_v0_dataproto_cache_imports(cluster, tmp_path, capsys):
    """verl's V0 RolloutSkip writes {step}/gen_batch.dp through its SkipManager.annotate decorator."""
    import numpy as np
    from verl.protocol import DataProto
    from verl.utils.skip import SkipManager
    from verl.utils.skip.rollout_skip import RolloutSkip

    verl_dir, dump = tmp_path / "verl", tmp_path / "ours"
    cfg = rig.compose(str(tmp_path / "unused"), steps=(1,),
                      extra=["skip.rollout_tq.enable=false", "skip.rollout.enable=true", f"skip.rollout.dump_dir={verl_dir}",
                             "skip.rollout.steps=[3]"])
    made = {}

    @SkipManager.annotate(role="rollout")
    def generate_sequences(_self, prompts):
        raw_prompt = np.empty(4, dtype=object)
        raw_prompt[:] = [[{"role": "user", "content": f"q{i}"}] for i in range(4)]
        out = DataProto.from_dict(
            tensors={"responses": torch.randint(0, 100, (4, 5)), "response_mask": torch.ones(4, 5, dtype=torch.int64)},
            non_tensors={"uid": np.array([f"u{i // 2}" for i in range(4)], dtype=object), "raw_prompt": raw_prompt},
            meta_info={"global_steps": 3, "timing": {"gen": 0.5}},
        )
        made["out"] = out
        return out

    with verls_own("rollout", RolloutSkip):
        SkipManager.init(cfg)
        SkipManager.set_step(3)
        generate_sequences(None, DataProto.from_dict(tensors={"x": torch.zeros(4)}))
    SkipManager.skip_instances = {}
    assert (verl_dir / f"{rig.EXPERIMENT}_{rig.PROJECT}" / "GBS4_N2_in8_out6" / "3" / "gen_batch.dp").is_file()

    code, doc, err = import_verl(capsys, verl_dir, dump)
    assert code == 0, err
    assert [(d["step"], d["trajectories"]) for d in doc["converted"]] == [(3, 4)]
    store = open_store(NamespaceKey(rig.EXPERIMENT, rig.PROJECT, 4, 2, 8, 6).layout(dump))
    assert {s.step: s.status for s in scan_namespace(store.layout, open_namespace(store.layout)).steps} == {3: "complete"}
    got, want = store.reader.read_inner(3, 0, 0), made["out"]
    assert isinstance(got, DataProto)
    for k in want.batch.keys():
        assert torch.equal(got.batch[k], want.batch[k])
    assert got.non_tensor_batch["uid"].tolist() == want.non_tensor_batch["uid"].tolist()
    assert got.non_tensor_batch["raw_prompt"].tolist() == want.non_tensor_batch["raw_prompt"].tolist()
    assert got.meta_info == want.meta_info


def test_a_step_verl_left_incomplete_fails_the_import_naming_it(cluster, tmp_path, capsys):
    from verl.utils.skip.rollout_skip import RolloutTqSkip

    verl_dir, dump = tmp_path / "verl", tmp_path / "ours"
    with verls_own("rollout_tq", RolloutTqSkip):
        rig.run_steps(rig.compose(str(verl_dir), K=2), buffer="sync", salt=1, steps=(1, 2))
    step2 = verl_dir / f"{rig.EXPERIMENT}_{rig.PROJECT}" / "GBS4_N2_in8_out6" / "2"
    (step2 / "1" / "tq_batch.pt").unlink()          # as a run killed between verl's two writes leaves it
    capsys.readouterr()
    code = main(["import-verl", str(verl_dir), str(dump), "--trust"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "converted 1 steps, kept 0, failed 1" in out
    assert f"step 2 ({step2}) was not converted" in err and "tq_batch.pt is missing" in err
