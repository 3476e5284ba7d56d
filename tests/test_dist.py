"""dist: the harness's collectives on a group that takes CPU tensors, real two-process gloo runs, and
no quiet W = 1 when the launcher says there are several processes."""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from skip_harness.run import dist as dist_mod
from skip_harness.run.dist import DistContext, _cpu_backend
from skip_harness.errors import HarnessUsageError


@pytest.fixture
def no_launcher_env(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_single_process_context(no_launcher_env):
    ctx = DistContext.current()
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size) == (0, 1, 0, 1)
    assert ctx.is_main and ctx.is_local_main
    assert ctx.all_true(True) is True and ctx.all_true(False) is False
    assert ctx.sum_floats([1, 2.5]) == [1.0, 2.5]
    assert ctx.broadcast({"a": 1}) == {"a": 1} and ctx.gather(3) == [3]
    ctx.barrier()


def test_world_size_one_in_the_env_is_a_single_process(no_launcher_env, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert DistContext.current().world_size == 1


def test_built_before_the_process_group_exists_says_so(no_launcher_env, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(HarnessUsageError) as err:
        DistContext.current()
    msg = str(err.value)
    assert "WORLD_SIZE=2" in msg and "init_process_group" in msg and "W = 1" in msg


@pytest.mark.parametrize(
    "config, cpu",
    [("gloo", "gloo"), ("cpu:gloo,cuda:gloo", "gloo"), ("cpu:gloo,cuda:nccl", "gloo"), ("cuda:nccl", None),
     ("nccl", None), ("undefined", None), ("mpi", "mpi")],
)
def test_cpu_backend_of_a_default_group(config, cpu):
    assert _cpu_backend(config) == cpu


class FakeDist:
    """torch.distributed as seen under an NCCL default group (no CUDA needed)."""

    class ReduceOp:
        MIN, SUM = "min", "sum"

    def __init__(self, backend_config="cuda:nccl"):
        self.group = SimpleNamespace(WORLD=object())
        self.backend_config = backend_config
        self.new_groups = []
        self.calls = []

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def get_rank(self):
        return 1

    def get_world_size(self):
        return 2

    def get_backend_config(self, group=None):
        return self.backend_config

    def is_gloo_available(self):
        return True

    def new_group(self, backend=None, **kwargs):
        g = SimpleNamespace(backend=backend)
        self.new_groups.append(g)
        return g

    def all_reduce(self, t, op=None, group=None):
        assert t.device.type == "cpu"
        self.calls.append(("all_reduce", group))

    def broadcast_object_list(self, box, src=0, group=None, device=None):
        self.calls.append(("broadcast_object_list", group))

    def all_gather_object(self, out, obj, group=None):
        out[:] = [obj] * len(out)
        self.calls.append(("all_gather_object", group))

    def barrier(self, group=None, **kwargs):
        self.calls.append(("barrier", group))


@pytest.fixture
def fake_nccl(monkeypatch, no_launcher_env):
    import torch.distributed

    fake = FakeDist()
    for name in ("is_available", "is_initialized", "get_rank", "get_world_size", "get_backend_config",
                 "is_gloo_available", "new_group", "all_reduce", "broadcast_object_list", "all_gather_object",
                 "barrier"):
        monkeypatch.setattr(torch.distributed, name, getattr(fake, name))
    monkeypatch.setattr(torch.distributed, "group", fake.group)
    monkeypatch.setattr(dist_mod, "_HARNESS_GROUP", [])
    return fake


def test_under_an_nccl_default_group_the_collectives_use_one_gloo_group(fake_nccl):
    ctx = DistContext.current()
    again = DistContext.current()
    assert [g.backend for g in fake_nccl.new_groups] == ["gloo"]        # made once
    [gloo] = fake_nccl.new_groups
    assert ctx.group is gloo and again.group is gloo and ctx.device == torch.device("cpu")
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size) == (1, 2, 1, 2)  # from host names
    fake_nccl.calls.clear()
    ctx.all_true(True)
    ctx.sum_floats([1.0])
    ctx.broadcast("x")
    ctx.gather("y")
    ctx.barrier()
    assert [c[0] for c in fake_nccl.calls] == ["all_reduce", "all_reduce", "broadcast_object_list",
                                               "all_gather_object", "barrier"]
    assert all(group is gloo for _, group in fake_nccl.calls)           # never the NCCL default group


def test_a_new_default_group_gets_a_new_gloo_group(fake_nccl):
    DistContext.current()
    fake_nccl.group.WORLD = object()   # destroy_process_group + init_process_group
    DistContext.current()
    assert len(fake_nccl.new_groups) == 2


def test_a_default_group_with_a_cpu_backend_is_used_as_is(fake_nccl, monkeypatch):
    fake_nccl.backend_config = "cpu:gloo,cuda:nccl"
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    ctx = DistContext.current()
    assert ctx.group is None and fake_nccl.new_groups == []
    assert (ctx.local_rank, ctx.local_world_size) == (0, 1)              # the launcher's values


# ------------------------------------------------------------------------------ real processes (gloo)


def _worker(rank: int, world: int, init_file: str, out_dir: str, pretend_nccl: bool) -> None:
    import torch.distributed as dist

    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["RANK"] = str(rank)
    result = {}
    try:
        DistContext.current()
        result["before_group"] = "no error"
    except HarnessUsageError as exc:
        result["before_group"] = str(exc)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    groups, reduce_groups = [], []
    if pretend_nccl:
        # A default group whose backend takes no CPU tensors: the harness must make its own gloo group.
        dist.get_backend_config = lambda group=None: "cuda:nccl"
        real_new_group, real_all_reduce = dist.new_group, dist.all_reduce

        def new_group(*a, **k):
            g = real_new_group(*a, **k)
            groups.append((k.get("backend"), g))
            return g

        def all_reduce(t, op=None, group=None, **k):
            reduce_groups.append(group)
            return real_all_reduce(t, op=op, group=group, **k)

        dist.new_group, dist.all_reduce = new_group, all_reduce
    ctx = DistContext.current()
    ctx2 = DistContext.current()
    result.update(
        rank=ctx.rank, world=ctx.world_size, local_rank=ctx.local_rank, local_world=ctx.local_world_size,
        all_true_mixed=ctx.all_true(rank == 0), all_true_all=ctx.all_true(True),
        sums=ctx.sum_floats([float(rank), 1.5]),
        broadcast=ctx.broadcast({"from": rank}), gather=ctx.gather(f"r{rank}"),
        new_groups=[b for b, _ in groups], same_group=ctx.group is ctx2.group,
        used_harness_group=bool(reduce_groups) and all(g is ctx.group and g is not None for g in reduce_groups),
    )
    ctx.barrier()
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    # Leave without running C++ static destructors: now and then a gloo thread left joinable at exit
    # aborts the process ("terminate called without an active exception", SIGABRT) after everything
    # above has run -- a torch exit-time fault, not the behaviour under test.
    os._exit(0)


@pytest.mark.slow  # two real processes
@pytest.mark.parametrize("pretend_nccl", [False, True], ids=["gloo-default", "non-gloo-default"])
def test_two_real_processes(tmp_path, pretend_nccl, no_launcher_env):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path), pretend_nccl), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert "init_process_group" in res["before_group"], res["before_group"]
        assert (res["rank"], res["world"]) == (r, 2)
        assert (res["local_rank"], res["local_world"]) == (r, 2)       # both on this host
        assert res["all_true_mixed"] is False and res["all_true_all"] is True
        assert res["sums"] == [1.0, 3.0]
        assert res["broadcast"] == {"from": 0}
        assert res["gather"] == ["r0", "r1"]
        if pretend_nccl:
            assert res["new_groups"] == ["gloo"] and res["same_group"] and res["used_harness_group"]
        else:
            assert res["new_groups"] == []


# ------------------------------------------------------------------------------ scripts/gpu_check.py

GPU_CHECK = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _gpu_check(*args: str):
    import subprocess
    import sys

    from conftest import subprocess_env

    return subprocess.run([sys.executable, str(GPU_CHECK), *args], capture_output=True, text=True,
                          env=subprocess_env(), timeout=600)


@pytest.mark.slow  # scripts/gpu_check.py in a subprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run scripts/gpu_check.py itself")
def test_gpu_check_skips_cleanly_without_a_gpu():
    proc = _gpu_check()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpu_check: skipped: no CUDA device") and "Traceback" not in proc.stderr
    doc = json.loads(_gpu_check("--json").stdout)
    assert doc["checks"] == [] and "no CUDA device" in doc["skipped"]


@pytest.mark.slow
def test_gpu_check_logic_on_the_cpu():
    """--cpu-dry-run: the same checks with gloo on the CPU, so the script's own logic is exercised here."""
    proc = _gpu_check("--cpu-dry-run", "--only", "payload,rng,nccl", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert [(c["check"], c["status"]) for c in doc["checks"]] == [("payload", "held"), ("rng", "held"), ("nccl", "held")]
