"""retention: the pure policy (ages, sizes, which steps go) and `skip-harness clean` applying it to real
caches made with StepStore: --keep-last, --older-than, --max-size, --pin, --dry-run, a locked namespace."""
from __future__ import annotations

import json
import time

import pytest

from conftest import write_step
from skip_harness.store.open import open_namespace, open_store
from skip_harness.cli import main
from skip_harness.units import human_bytes
from skip_harness.store.layout import NamespaceKey
from skip_harness.store.retention import RetentionRules, StepAge, parse_age, parse_size, plan_retention
from skip_harness.store.scan import scan_namespace
from skip_harness.store.stepstore import StepStore

DAY = 86400.0


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("text,seconds", [("90s", 90), ("30m", 1800), ("12h", 43200), ("7d", 7 * DAY),
                                          ("2w", 14 * DAY), ("1.5h", 5400), (" 3D ", 3 * DAY)])
def test_parse_age(text, seconds):
    assert parse_age(text) == seconds


@pytest.mark.parametrize("text,size", [("20GiB", 20 << 30), ("500MiB", 500 << 20), ("1TB", 10**12), ("10", 10),
                                       ("1.5KiB", 1536), ("3 kb", 3000)])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["", "7", "7y", "-1d", "d"])
def test_parse_age_rejects(bad):
    with pytest.raises(ValueError, match="90s, 30m"):
        parse_age(bad)


@pytest.mark.parametrize("bad", ["", "GiB", "20PB", "-5MiB"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="20GiB"):
        parse_size(bad)


def ages(*specs, ns="a"):
    """StepAge per (step, bytes, written) spec, servable."""
    return [StepAge(ns, step, nbytes, written, True) for step, nbytes, written in specs]


def test_keep_last_keeps_the_newest_per_namespace_and_pins():
    steps = ages((1, 10, 1.0), (2, 10, 2.0), (3, 10, 3.0), (4, 10, 4.0)) + ages((1, 10, 5.0), (2, 10, 6.0), ns="b")
    out = plan_retention(steps, RetentionRules(keep_last=2, pins=frozenset({1})), now=10.0)
    assert {ns: [s for s, _ in items] for ns, items in out.items()} == {"a": [2]}
    assert "--keep-last" in out["a"][0][1]


def test_keep_last_keeps_by_write_time_and_its_reason_says_so():
    """Steps 1-2 rewritten after 3-4 (a rerun): --keep-last 2 keeps 1 and 2. The reason read "older than the
    last 2 steps", which named steps 3 and 4 as older than the last two step numbers: it says what the rule does."""
    steps = ages((3, 10, 1.0), (4, 10, 2.0), (1, 10, 3.0), (2, 10, 4.0))
    out = plan_retention(steps, RetentionRules(keep_last=2), now=10.0)
    assert out == {"a": [(3, "not one of the 2 most recently written steps (--keep-last)"),
                         (4, "not one of the 2 most recently written steps (--keep-last)")]}


def test_keep_last_zero_removes_every_unpinned_step():
    steps = ages((1, 10, 1.0), (2, 10, 2.0))
    out = plan_retention(steps, RetentionRules(keep_last=0, pins=frozenset({2})), now=10.0)
    assert [s for s, _ in out["a"]] == [1]


def test_older_than_uses_the_write_time():
    steps = ages((1, 10, 100.0), (2, 10, 200.0), (3, 10, 300.0))
    out = plan_retention(steps, RetentionRules(older_than_s=150.0), now=400.0)
    assert [s for s, _ in out["a"]] == [1, 2]
    assert "--older-than" in out["a"][0][1]


def test_max_size_removes_oldest_first_across_namespaces_never_pins():
    steps = ages((1, 100, 1.0), (2, 100, 4.0)) + ages((1, 100, 2.0), (2, 100, 3.0), ns="b")
    out = plan_retention(steps, RetentionRules(max_size_bytes=250), now=10.0)
    assert out == {"a": [(1, out["a"][0][1])], "b": [(1, out["b"][0][1])]}
    out = plan_retention(steps, RetentionRules(max_size_bytes=250, pins=frozenset({1})), now=10.0)
    assert {ns: [s for s, _ in items] for ns, items in out.items()} == {"b": [2], "a": [2]}
    # bytes of steps that are not servable are going anyway: they do not count
    steps.append(StepAge("a", 9, 10_000, 0.5, False))
    assert sum(len(v) for v in plan_retention(steps, RetentionRules(max_size_bytes=250), now=10.0).values()) == 2


def test_no_rule_removes_nothing():
    assert plan_retention(ages((1, 10, 1.0)), RetentionRules(), now=10.0) == {}


# --------------------------------------------------------------------------------------------
# the command on real caches


def set_written(store, step, when):
    """Date a committed step back: its commit record's time (the commit record lists no checksum of itself)."""
    path = store.layout.commit_path(step)
    doc = json.loads(path.read_text())
    doc["created"] = when
    path.write_text(json.dumps(doc))


@pytest.fixture
def cache(tmp_path):
    dump = tmp_path / "dump"
    store = open_store(NamespaceKey("e", "p", 8, 2, 4, 4).layout(dump))
    now = time.time()
    for step in range(1, 6):
        write_step(store, step)
        set_written(store, step, now - (6 - step) * DAY)   # step 1 is 5 days old ... step 5 one day
    write_step(store, 6, commit=False)                     # an interrupted step: removed by any clean
    return dump, store


def remaining(store):
    return {s.step: s.status for s in scan_namespace(store.layout, open_namespace(store.layout)).steps}


def test_clean_keep_last_with_a_pin(cache, capsys):
    dump, store = cache
    code, out, _ = run(capsys, "clean", str(dump), "--keep-last", "2", "--pin", "1")
    assert code == 0
    assert remaining(store) == {1: "complete", 4: "complete", 5: "complete"}


def test_clean_older_than(cache, capsys):
    dump, store = cache
    code, out, _ = run(capsys, "clean", str(dump), "--older-than", "3.5d", "--json")
    assert code == 0
    doc = json.loads(out)["namespaces"][0]
    assert sorted((s["step"], s["status"]) for s in doc["steps"]) == [(1, "retention"), (2, "retention"),
                                                                     (6, "incomplete")]
    assert remaining(store) == {3: "complete", 4: "complete", 5: "complete"}


def test_clean_max_size_oldest_first_and_pins(cache, capsys):
    dump, store = cache
    per_step = scan_namespace(store.layout, open_namespace(store.layout)).get(1).bytes
    code, out, err = run(capsys, "clean", str(dump), "--max-size", f"{2 * per_step + per_step // 2}", "--pin", "2")
    assert code == 0
    assert remaining(store) == {2: "complete", 5: "complete"}
    # pins that alone exceed the budget stay, with a warning
    code, out, err = run(capsys, "clean", str(dump), "--max-size", "1", "--pin", "2,5")
    assert code == 0 and remaining(store) == {2: "complete", 5: "complete"}
    assert "over --max-size" in err


def test_clean_retention_dry_run_shows_what_would_go_and_the_bytes(cache, capsys):
    dump, store = cache
    before = sorted(str(p) for p in dump.rglob("*"))
    report = scan_namespace(store.layout, open_namespace(store.layout))
    expected = sum(report.get(s).bytes for s in (1, 2, 3, 6))
    code, out, _ = run(capsys, "clean", str(dump), "--keep-last", "2", "--dry-run")
    assert code == 0
    assert f"would remove 4 steps, {human_bytes(expected)}" in out and f"{expected} bytes" not in out
    # one row per reason, with its steps and count (not one identical row per step)
    rows = [r for r in _rows(out) if len(r) == 5]
    assert sorted((r[0], r[1], r[2]) for r in rows) == [("1-3", "3", "retention"), ("6", "1", "incomplete")], rows
    assert sorted(str(p) for p in dump.rglob("*")) == before


def _rows(text):
    return [[c.strip() for c in line.strip().strip("│").split("│")] for line in text.splitlines()
            if line.strip().startswith("│")]


def test_clean_retention_refuses_a_locked_namespace(cache, capsys, lock_holder):
    dump, store = cache
    holder = lock_holder(store.layout)
    for extra in ([], ["--dry-run"]):
        code, out, err = run(capsys, "clean", str(dump), "--keep-last", "1", *extra)
        assert code == 3 and f"pid {holder.pid}" in err
    assert len(remaining(store)) == 6


@pytest.mark.parametrize("argv,needle", [(["--keep-last", "-1"], "--keep-last"), (["--older-than", "7y"], "7y"),
                                         (["--max-size", "lots"], "lots"), (["--pin", "x"], "--pin")])
def test_clean_bad_retention_flags_are_one_line_errors(cache, capsys, argv, needle):
    dump, store = cache
    with pytest.raises(SystemExit) as exc:
        main(["clean", str(dump), *argv])
    _, err = capsys.readouterr()
    assert exc.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert len(remaining(store)) == 6
