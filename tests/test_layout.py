"""layout: pure path arithmetic for namespaces, steps, inner indices and ranks."""
from pathlib import Path

import pytest

from skip_harness.store.layout import (
    Layout,
    NamespaceKey,
    parse_namespace_leaf,
    parse_step_name,
)


def key(K=1, W=1):
    return NamespaceKey("exp", "proj", 64, 4, 128, 256, K=K, W=W)


def test_namespace_name_is_verls_when_k_and_w_are_one(tmp_path):
    lay = key().layout(tmp_path)
    assert lay.root == tmp_path / "exp_proj" / "GBS64_N4_in128_out256"


@pytest.mark.parametrize("K,W", [(4, 1), (1, 2), (2, 2)])
def test_namespace_name_carries_k_and_w_otherwise(tmp_path, K, W):
    lay = key(K, W).layout(tmp_path)
    assert lay.root.name == f"GBS64_N4_in128_out256_K{K}_W{W}"
    assert (lay.K, lay.W) == (K, W)
    assert parse_namespace_leaf(lay.root.name) == (K, W)


def test_runs_differing_in_k_or_w_never_share_a_namespace(tmp_path):
    roots = {key(K, W).layout(tmp_path).root for K in (1, 2, 4) for W in (1, 2)}
    assert len(roots) == 6


def test_parse_namespace_leaf():
    assert parse_namespace_leaf("GBS64_N4_in128_out256") == (1, 1)
    assert parse_namespace_leaf("GBS64_N4_in128_out256_K3_W2") == (3, 2)
    assert parse_namespace_leaf("GBS64_N4_in128") == (1, 1)  # a trainer without max_response_length
    for bad in ("gbs64_N4_in128_out256", "GBS64_N4_in128_out256_K3", "x", ".quarantine"):
        assert parse_namespace_leaf(bad) is None


def test_namespace_names_only_the_shape_values_a_trainer_has(tmp_path):
    # A trainer without verl's keys (TRL: no max_prompt_length) names what it has; K and W are always
    # in the name when nothing else is.
    assert NamespaceKey("e", "p", n=4, K=2).leaf_name == "N4_K2_W1"
    assert NamespaceKey("e", "p", train_batch_size=8, max_response_length=32).leaf_name == "GBS8_out32"
    assert NamespaceKey("e", "p").leaf_name == "K1_W1"
    for k in (NamespaceKey("e", "p", n=4, K=2), NamespaceKey("e", "p", train_batch_size=8, max_response_length=32),
              NamespaceKey("e", "p", W=3)):
        assert parse_namespace_leaf(k.leaf_name) == (k.K, k.W)
    assert NamespaceKey("e", "p", n=4).with_world_size(2).leaf_name == "N4_K1_W2"


def test_parse_namespace_leaf_rejects_reordered_or_repeated_tokens():
    for bad in ("N4_GBS8", "N4_N4", "K2", "W1_K1", "K0_W1", "N4_K2_W0", "N04"):
        assert parse_namespace_leaf(bad) is None, bad


def test_parse_step_name_accepts_only_canonical_ints():
    assert parse_step_name("0") == 0  # 0-based trainers (TRL) store step 0
    assert parse_step_name("1") == 1
    assert parse_step_name("12345") == 12345
    for bad in ("01", "-1", "1.0", "a", "", ".lock", ".trash-3-1-ab", "3 "):
        assert parse_step_name(bad) is None


def test_k1_files_sit_in_the_step_directory():
    lay = Layout(Path("/ns"), K=1, W=1)
    assert lay.payload_rel(0, 0) == "tq_batch.pt"
    assert lay.meta_rel(0, 0) == "meta.json"
    assert lay.payload_path(5, 0, 0) == Path("/ns/5/tq_batch.pt")
    assert lay.inner_dir(5, 0) == Path("/ns/5")
    assert lay.commit_path(5) == Path("/ns/5/commit.json")


def test_k_above_one_uses_inner_directories():
    lay = Layout(Path("/ns"), K=3, W=1)
    assert lay.payload_rel(2, 0) == "2/tq_batch.pt"
    assert lay.meta_path(7, 1, 0) == Path("/ns/7/1/meta.json")
    assert lay.inner_dir(7, 2) == Path("/ns/7/2")


def test_w_above_one_names_each_ranks_shard():
    lay = Layout(Path("/ns"), K=2, W=2)
    assert lay.payload_rel(1, 1) == "1/tq_batch_rank1.pt"
    assert lay.meta_rel(0, 1) == "0/meta_rank1.json"
    lay1 = Layout(Path("/ns"), K=1, W=2)
    assert lay1.payload_rel(0, 0) == "tq_batch_rank0.pt"


def test_legacy_k1_form_and_expected_rels():
    lay = Layout(Path("/ns"), K=1, W=1)
    assert lay.legacy_k1_rel(0) == ("0/tq_batch.pt", "0/meta.json")
    lay = Layout(Path("/ns"), K=2, W=2)
    rels = list(lay.expected_rels())
    assert len(rels) == 4
    assert rels[0] == (0, 0, "0/tq_batch_rank0.pt", "0/meta_rank0.json")
    assert list(lay.expected_rels(ranks=range(1, 2))) == [
        (0, 1, "0/tq_batch_rank1.pt", "0/meta_rank1.json"),
        (1, 1, "1/tq_batch_rank1.pt", "1/meta_rank1.json"),
    ]


def test_lock_and_quarantine_paths():
    lay = Layout(Path("/ns"), K=1, W=1)
    assert lay.lock_path == Path("/ns/.lock")
    assert lay.lock_holder_path == Path("/ns/.lock.holder.json")
    assert lay.quarantine_dir == Path("/ns/.quarantine")


def test_the_older_k1_form_is_resolved_in_one_place(tmp_path):
    k1, k2 = Layout(tmp_path / "a", K=1, W=2), Layout(tmp_path / "b", K=2, W=1)
    have = {"0/tq_batch_rank1.pt", "0/meta_rank1.json", "tq_batch_rank0.pt", "meta_rank0.json"}.__contains__
    assert k1.stored_rels(0, 0, have) == ("tq_batch_rank0.pt", "meta_rank0.json")
    assert k1.stored_rels(0, 1, have) == ("0/tq_batch_rank1.pt", "0/meta_rank1.json")
    assert k1.stored_rels(0, 1, lambda rel: False) == ("tq_batch_rank1.pt", "meta_rank1.json")
    assert k2.stored_rels(0, 0, lambda rel: True) == ("0/tq_batch.pt", "0/meta.json")
    assert [k1.position_of(r) for r in ("tq_batch_rank1.pt", "0/tq_batch_rank1.pt", "meta_rank1.json")] == [(0, 1), (0, 1), None]
    assert k2.position_of("1/tq_batch.pt") == (1, 0) and k2.position_of("tq_batch.pt") is None
