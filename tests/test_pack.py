"""Issue 39, item 3: `skip-harness pack` / `unpack` -- one recording as one portable, checksummed file, served
by `replay_from=FILE` in place and read by `ls`, `verify`, `show`, `diff` and `view` as a namespace.

In-process runs of the plain-dict API on the rig of tests/reshard_rig.py (rows known by content), real
files in tmp_path, the command line through `skip_harness.cli.main`."""
from __future__ import annotations

import json
import logging
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

import reshard_rig
from skip_harness import SkipHarness
from skip_harness.cli import main
from skip_harness.errors import ConfigError
from skip_harness.store.api import (PackError, StepStore, TierStore, bless_pack, is_pack, namespaces_at, open_namespace,
                                    read_pack_info, unpack, write_pack)
from skip_harness.store.packfile import MANIFEST_NAME, PackMember, PackReadOnly, write_pack_file

NS = {"experiment_name": "rig", "project_name": "pack", "train_batch_size": reshard_rig.B, "n": reshard_rig.N}
LEAF = "GBS8_N2_K2_W1"


def run(dump: Path, K: int, steps: int, replay_from=None, lr: float = 0.1, **ns):
    """One W = 1 run of the rig's loop: ({step: (outcome, [row ids of each call])}, summary, trainer)."""
    settings = {"enable": True, "dump_dir": str(dump)}
    if replay_from is not None:
        settings["replay_from"] = str(replay_from)
    harness = SkipHarness.create(settings, namespace={**NS, **ns, "K": K}, fingerprint={"seed": 0},
                                 training_config={"optim": {"lr": lr}})
    trainer = reshard_rig.Trainer(K, 1, 0)
    harness.wrap(trainer)
    out = {}
    for step in range(1, steps + 1):
        trainer.prepare_data(step)
        calls = [trainer.sample(step)["ids"].tolist() for _ in range(K)]
        out[step] = (str(harness.outcome(step)), calls)
        harness.observe(step, rows=float(sum(len(c) for c in calls)), loss=float(step) * lr)
    return out, harness.close(), trainer


@pytest.fixture
def recording(tmp_path):
    """A K = 2 recording of 4 steps with values and a training-side config: its namespace's root."""
    run(tmp_path / "rec", 2, 4)
    root = tmp_path / "rec" / "rig_pack" / LEAF
    assert (root / ".values").is_dir()
    return root


def files_of(root: Path, steps) -> dict:
    """{relative path: bytes} of the steps' files, their values and the configs they name."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        top = rel.split("/")[0]
        if p.is_file() and (top in {str(s) for s in steps} or (top == ".values" and "/runs/" not in rel
                                                                and (rel.startswith(".values/config-") or
                                                                     rel[len(".values/"):-5] in {str(s) for s in steps}))):
            out[rel] = p.read_bytes()
    return out


def member_offset(pack: Path, name: str) -> int:
    with zipfile.ZipFile(pack) as zf:
        info = zf.getinfo(name)
    return info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)


def flip(pack: Path, name: str, at: int = 100) -> None:
    data = bytearray(pack.read_bytes())
    data[member_offset(pack, name) + at] ^= 0xFF
    pack.write_bytes(bytes(data))


def add_tier(root: Path, step: int) -> float:
    """A second-tier entry (rewards) for `step` of the namespace at `root`, bound to its commit record."""
    layout = namespaces_at(root)[0]
    ns = open_namespace(layout)
    created = StepStore(layout, ns).reader.read_commit(step).created
    hold = ns.lock()
    try:
        assert TierStore(ns).write(step, "reward", 0, 0, {"reward": "r1"}, TierStore.encode(torch.arange(3.0)),
                                   commit_created=created, seconds=0.5)
    finally:
        hold.release()
    return created


def test_pack_and_unpack_round_trip_byte_identical(recording, tmp_path):
    created = add_tier(recording, 2)
    pack = tmp_path / "rec.shpack"
    info = write_pack(recording, pack)
    assert is_pack(pack) and info.steps == (1, 2, 3, 4) and (info.K, info.W) == (2, 1)
    assert info.namespace == f"rig_pack/{LEAF}" and info.fingerprint["values"] == {"seed": 0}
    assert info.training_config == {"optim.lr": 0.1}
    with zipfile.ZipFile(pack) as zf:            # a plain ZIP of stored members, the manifest first
        assert zf.infolist()[0].filename == MANIFEST_NAME
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())
        assert not any(str(tmp_path) in zf.read(i).decode("latin-1") for i in zf.infolist())   # no absolute path
    packed = open_namespace(namespaces_at(pack)[0])       # the second tier, served from the pack
    entry = TierStore(packed).read(2, "reward", {"reward": "r1"}, 0, 0, commit_created=created)
    assert entry is not None and entry.values.tolist() == [0.0, 1.0, 2.0]
    root = unpack(pack, tmp_path / "restored")
    assert root == tmp_path / "restored" / "rig_pack" / LEAF
    assert files_of(root, range(1, 5)) == files_of(recording, range(1, 5))
    tier = sorted(p.relative_to(recording).as_posix() for p in (recording / ".tier").rglob("*") if p.is_file())
    assert len(tier) == 2
    assert all((root / t).read_bytes() == (recording / t).read_bytes() for t in tier)
    assert unpack(pack, tmp_path / "restored") == root        # again: the same steps are left as they are
    assert main(["verify", str(root)]) == 0


def test_the_pack_size_is_the_namespaces_bytes_and_a_small_overhead(recording, tmp_path):
    info = write_pack(recording, tmp_path / "p")
    on_disk = sum(len(b) for b in files_of(recording, range(1, 5)).values())
    assert info.bytes == on_disk
    assert info.file_bytes == (tmp_path / "p").stat().st_size
    # the manifest (name, size and checksum of each member) and ZIP headers: about 200 bytes a member
    assert 0 < info.overhead < 512 + 256 * info.members, (info.overhead, info.members)


def test_steps_range(recording, tmp_path, capsys):
    pack = tmp_path / "two.pack"
    assert main(["pack", str(recording), "--steps", "2-3", "-o", str(pack)]) == 0
    out = capsys.readouterr().out
    assert f"packed rig_pack/{LEAF} (steps 2-3) into {pack}" in out
    assert read_pack_info(pack).steps == (2, 3)
    assert main(["ls", str(pack), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["step"] for s in doc["namespaces"][0]["steps"]] == [2, 3]
    assert main(["pack", str(recording), "--steps", "7-9", "-o", str(tmp_path / "none")]) == 2
    assert "no complete step to pack among steps 7-9" in capsys.readouterr().err
    assert main(["pack", str(recording), "--steps", "x-2", "-o", str(tmp_path / "none")]) == 2


def test_replay_from_a_copied_pack_serves_every_step_and_generates_nothing(recording, tmp_path, caplog):
    """Made on one machine, replayed on another: the pack copied elsewhere under another name (no extension:
    told by its bytes), the recording and its first copy removed."""
    first = tmp_path / "made_here" / "rec.pack"
    write_pack(recording, first)
    elsewhere = tmp_path / "other_machine" / "recording"
    elsewhere.parent.mkdir()
    shutil.copy(first, elsewhere)
    shutil.rmtree(tmp_path / "made_here")
    shutil.rmtree(tmp_path / "rec")
    before = elsewhere.read_bytes()
    with caplog.at_level(logging.INFO, logger="skip_harness"):
        served, summary, trainer = run(tmp_path / "replay", 2, 4, replay_from=elsewhere)
    assert trainer.generated == 0 and summary.hits == 4 and summary.misses == 0
    assert [o for o, _ in served.values()] == ["hit"] * 4
    assert served[3][1] == [[3000 + 8 * i + j for j in range(8)] for i in range(2)]
    assert "replay: 4 of 4 served steps reproduced" in str(summary)
    served, summary, trainer = run(tmp_path / "replay4", 4, 4, replay_from=elsewhere)   # another K: re-chunked
    assert trainer.generated == 0 and summary.hits == 4
    assert served[3][1] == [[3000 + 4 * i + j for j in range(4)] for i in range(4)]
    assert elsewhere.read_bytes() == before      # never written


def test_replay_from_a_pack_checks_its_batch(recording, tmp_path):
    pack = tmp_path / "rec.pack"
    write_pack(recording, pack)
    with pytest.raises(ConfigError, match=r"skip\.rollout_tq\.replay_from: .*rec\.pack cannot serve this run: "
                                          r"another batch \(data\.train_batch_size: the recording has 8, this run has 16"):
        run(tmp_path / "replay", 2, 1, replay_from=pack, train_batch_size=16)


def test_a_flipped_byte_is_reported_by_verify_and_refused_by_a_replay(recording, tmp_path, capsys, caplog):
    pack = tmp_path / "rec.pack"
    write_pack(recording, pack)
    flip(pack, "2/1/tq_batch.pt")
    assert main(["verify", str(pack)]) == 1
    out = capsys.readouterr().out.replace("\n", " ")
    assert "(member 2/1/tq_batch.pt)" in out and "checksum" in out
    with caplog.at_level(logging.WARNING, logger="skip_harness"):
        served, summary, trainer = run(tmp_path / "replay", 2, 3, replay_from=pack)
    assert [o for o, _ in served.values()] == ["hit", "miss", "hit"]
    assert trainer.generated == 2                # step 2 generated again, whole
    assert any("rec.pack (member 2/1/tq_batch.pt)" in r.getMessage() for r in caplog.records)


def test_a_damaged_manifest_or_value_member_is_named(recording, tmp_path, capsys):
    pack = tmp_path / "rec.pack"
    write_pack(recording, pack)
    flip(pack, ".values/3.json", at=5)
    ns = open_namespace(namespaces_at(pack)[0])
    with pytest.raises(Exception, match=r"rec\.pack \(member \.values/3\.json\): checksum"):
        ns.storage.get(".values/3.json")
    data = bytearray(pack.read_bytes())
    data[40] ^= 0xFF                             # inside the manifest: its CRC-32 fails
    pack.write_bytes(bytes(data))
    assert main(["ls", str(pack)]) == 2
    assert "rec.pack" in capsys.readouterr().err


def test_ls_verify_show_and_diff_read_a_pack(recording, tmp_path, capsys):
    pack = tmp_path / "rec.pack"
    write_pack(recording, pack)
    assert main(["ls", str(pack), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ns = doc["namespaces"][0]
    assert (ns["K"], ns["W"], ns["counts"]["complete"]) == (2, 1, 4)
    assert ns["pack"]["namespace"] == f"rig_pack/{LEAF}" and ns["pack"]["blessed"] == []
    assert main(["verify", str(pack)]) == 0
    assert "every complete step verifies" in capsys.readouterr().out
    assert main(["show", str(pack), "3", "1", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["status"] == "complete" and shown["step"] == 3 and shown["pack"]["steps"] == [1, 2, 3, 4]
    assert any(r["key"] == "ids" and r["shape"] == "(8,)" for r in shown["structure"])
    assert main(["diff", str(pack), str(recording)]) == 0
    assert "identical" in capsys.readouterr().out
    run(tmp_path / "other", 2, 2, lr=0.5)
    other = tmp_path / "other" / "rig_pack" / LEAF
    assert main(["diff", str(pack), str(other)]) == 1       # values differ (loss = step x lr)
    assert "values" in capsys.readouterr().out


def test_view_reads_a_pack(recording, tmp_path):
    pytest.importorskip("starlette")
    pytest.importorskip("jinja2")
    from starlette.testclient import TestClient

    from skip_harness.cli.view.app import build_app
    from skip_harness.cli.view.data import Cache
    from skip_harness.cli.view.decode import Decoder

    pack = tmp_path / "rec.pack"
    write_pack(recording, pack)
    before = pack.read_bytes()
    client = TestClient(build_app(Cache([pack]), Decoder(), ["testserver"]), raise_server_exceptions=True)
    names = client.get("/api/namespaces").json()
    assert [n["path"] for n in names["namespaces"]] == [str(pack)]
    key = f"0/rig_pack/{LEAF}"
    one = client.get(f"/api/ns/{key}").json()
    assert [s["status"] for s in one["steps"]] == ["complete"] * 4
    step = client.get(f"/api/ns/{key}/step/2").json()
    assert step["step"] == 2 and step.get("reason") in (None, "")
    assert client.get(f"/ns/{key}/step/2").status_code == 200
    assert pack.read_bytes() == before


def test_bless_pack_replaces_values_and_keeps_a_history(recording, tmp_path, capsys):
    pack = tmp_path / "rec.pack"
    write_pack(recording, pack)
    reader = open_namespace(namespaces_at(pack)[0])
    before = StepStore(namespaces_at(pack)[0], reader).reader.read_values(2)
    assert before["loss"] == pytest.approx(0.2)
    bless_pack(pack, {2: {"loss": 0.202, "rows": 16.0}, 3: {"loss": 0.303, "rows": 16.0}},
               {"optim": {"lr": 0.101}}, "lr x 1.01 on purpose")
    layout = namespaces_at(pack)[0]
    store = StepStore(layout, open_namespace(layout))
    assert store.reader.read_values(2) == {"loss": 0.202, "rows": 16.0}
    assert store.reader.read_values(1)["loss"] == pytest.approx(0.1)       # untouched
    assert store.reader.read_step_values(3) is not None
    digest = store.reader.read_step_values(3).config
    assert store.reader.read_training_config(digest) == {"optim.lr": 0.101}
    info = read_pack_info(pack)
    assert info.training_config == {"optim.lr": 0.101}
    (entry,) = info.blessed
    assert entry["reason"] == "lr x 1.01 on purpose" and entry["steps"] == [2, 3]
    assert entry["config_changes"] == [{"key": "optim.lr", "recorded": 0.1, "now": 0.101}]
    assert main(["verify", str(pack)]) == 0                 # every member still checks
    capsys.readouterr()
    assert main(["ls", str(pack)]) == 0
    out = capsys.readouterr().out
    assert "blessed" in out and "lr x 1.01 on purpose" in out and "optim.lr: 0.1 -> 0.101" in out
    assert main(["show", str(pack), "2"]) == 0
    assert "lr x 1.01 on purpose" in capsys.readouterr().out
    with pytest.raises(PackError, match="holds no step 9"):
        bless_pack(pack, {9: {"loss": 1.0}}, None, "no such step")


def test_a_pack_refuses_every_write(recording, tmp_path, capsys):
    pack = tmp_path / "rec.pack"
    write_pack(recording, pack)
    ns = open_namespace(namespaces_at(pack)[0])
    assert ns.writable() is not None and ns.lock().read_only
    with pytest.raises(PackReadOnly, match="read only"):
        ns.storage.put("1/x.json", b"{}")
    with pytest.raises(PackReadOnly):
        ns.remove_step(1)


def test_no_pickle_in_a_pack(recording, tmp_path, capsys):
    """A member named like a pickle makes the pack refused; a member that is neither JSON nor a codec file
    image (a torch.save pickle) is refused when read."""
    good = tmp_path / "rec.pack"
    write_pack(recording, good)
    info = read_pack_info(good)
    with zipfile.ZipFile(good) as zf:
        members = {n: zf.read(n) for n in zf.namelist() if n != MANIFEST_NAME}
    manifest = {k: v for k, v in info.extra.items() if k != "members"}
    from skip_harness.store.checksum import checksum_bytes

    def pack_of(path: Path, blobs: dict) -> Path:
        write_pack_file(path, manifest, [PackMember(n, len(b), checksum_bytes(b), lambda b=b: b) for n, b in sorted(blobs.items())])
        return path

    evil = pack_of(tmp_path / "evil.pack", {**members, "1/0/evil.pkl": b"cos\nsystem\n(S'true'\ntR."})
    assert is_pack(evil)
    with pytest.raises(PackError, match=r"member '1/0/evil\.pkl': named like a pickle"):
        namespaces_at(evil)
    assert main(["ls", str(evil)]) == 2
    assert "named like a pickle" in capsys.readouterr().err
    import io
    buf = io.BytesIO()
    torch.save({"ids": torch.arange(4)}, buf)
    sneaky = pack_of(tmp_path / "sneaky.pack", {**members, "1/0/tq_batch.pt": buf.getvalue()})
    ns = open_namespace(namespaces_at(sneaky)[0])
    with pytest.raises(Exception, match=r"sneaky\.pack \(member 1/0/tq_batch\.pt\): neither JSON nor a skip_harness"):
        ns.storage.get("1/0/tq_batch.pt")


def test_unpack_refuses_another_recording_of_a_step(recording, tmp_path, capsys):
    pack = tmp_path / "rec.pack"
    write_pack(recording, pack)
    run(tmp_path / "other", 2, 1, lr=0.5)       # step 1 recorded again: another commit record
    assert main(["unpack", str(pack), str(tmp_path / "other")]) == 2
    assert "holds another recording of this step" in capsys.readouterr().err
    assert main(["unpack", str(pack), str(tmp_path / "fresh")]) == 0
    assert "steps 1-4 of rig_pack/GBS8_N2_K2_W1 restored and verified" in capsys.readouterr().out


def test_ls_of_a_directory_lists_the_packs_in_it(recording, tmp_path, capsys):
    """`skip-harness ls DIR` lists the pack files directly in DIR (told by their first bytes, whatever their
    names) after its namespaces; a file that starts like a pack but cannot be read is named, not listed."""
    dump = tmp_path / "rec"
    write_pack(recording, dump / "kept.pack")
    write_pack(recording, dump / "no_suffix", steps=(1, 2))
    (dump / "notes.txt").write_text("not a pack")
    assert main(["ls", str(dump), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {n["path"]: n["counts"]["complete"] for n in doc["namespaces"]} == \
        {str(recording): 4, str(dump / "kept.pack"): 4, str(dump / "no_suffix"): 2}
    assert main(["ls", str(dump)]) == 0
    out = capsys.readouterr().out
    assert "kept.pack" in out and "no_suffix" in out and "a pack of rig_pack" in out
    data = bytearray((dump / "kept.pack").read_bytes())
    data[70] ^= 0xFF                             # inside its manifest: its CRC-32 fails
    (dump / "kept.pack").write_bytes(bytes(data))
    assert main(["ls", str(dump), "--json"]) == 0
    got = capsys.readouterr()
    assert sorted(n["path"] for n in json.loads(got.out)["namespaces"]) == sorted([str(recording), str(dump / "no_suffix")])
    assert f"{dump / 'kept.pack'}: a damaged pack" in got.err and "not listed" in got.err
