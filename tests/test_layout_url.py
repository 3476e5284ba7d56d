"""An object-store dump_dir stays a URL in the layout (issue 16): `Path("s3://b/x")` would fold it into
the local directory `s3:/b/x`, and the run would write there silently."""
from __future__ import annotations

import os

import pytest

from skip_harness.store.layout import NamespaceKey, UrlPath


def test_a_url_dump_dir_stays_a_url_and_is_never_a_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    layout = NamespaceKey("e", "p", train_batch_size=8, n=2, K=4).layout("s3://bucket/prefix")
    assert layout.is_url
    assert layout.url == "s3://bucket/prefix/e_p/GBS8_N2_K4_W1"
    assert str(layout.inner_dir(3, 1)) == "s3://bucket/prefix/e_p/GBS8_N2_K4_W1/3/1"
    assert str(layout.payload_path(3, 0, 0)) == "s3://bucket/prefix/e_p/GBS8_N2_K4_W1/3/0/tq_batch.pt"
    assert str(layout.root.parent.parent) == "s3://bucket/prefix"
    assert str(layout.step_dir(3).relative_to(layout.root)) == "3"
    with pytest.raises(TypeError):          # nothing can open it as a local file by mistake
        os.fspath(layout.root)
    assert not (tmp_path / "s3:").exists()


def test_a_local_dump_dir_is_a_path_as_before(tmp_path):
    layout = NamespaceKey("e", "p", train_batch_size=8, n=2).layout(tmp_path)
    assert not layout.is_url and layout.root == tmp_path / "e_p" / "GBS8_N2"
    assert not NamespaceKey("e", "p").layout("file:///tmp/x").is_url


def test_a_bucket_root_url_keeps_its_scheme():
    root = UrlPath("s3://bucket") / "e_p" / "K1_W1"
    assert str(root.parent.parent) == "s3://bucket" and root.name == "K1_W1"
    assert UrlPath("s3://bucket/x") == UrlPath("s3://bucket/x/")
