"""Installed is enough: skip_harness's ``verl.plugins`` entry point makes verl (0.9.x, which loads every entry
point of that group in every process unless ``VERL_USE_EXTERNAL_PLUGINS=none``) build skip_harness's
``skip.rollout_tq`` class, with no environment variable; and verl beside current TRL (>= 1.13, which removed
``AutoModelForCausalLMWithValueHead``) still runs the monkey patch that imports it. Real subprocesses, each
a fresh ``import verl`` in this environment (the package's installed metadata is what verl reads)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

pytestmark = pytest.mark.verl

WHICH = ("import verl\n"
         "from verl.utils.skip.base_skip import SKIP_REGISTRY\n"
         "print('ROLLOUT_TQ', SKIP_REGISTRY['rollout_tq'].__module__)\n")


def _python(code: str, tmp_path, **env_changes: str) -> subprocess.CompletedProcess:
    return _pythons(tmp_path, (code, env_changes))[0]


def _pythons(tmp_path, *runs) -> list:
    """Each (code, env changes) in a fresh ``python -c``, all at once (each is mostly ``import verl``), in order."""
    procs = []
    for code, env_changes in runs:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
        env.update(env_changes)
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def _rollout_tq(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("ROLLOUT_TQ ")]
    return line.split()[1]


def test_installed_is_enough_and_verls_switch_turns_it_off(tmp_path):
    installed, off, modules = _pythons(
        tmp_path, (WHICH, {}), (WHICH, {"VERL_USE_EXTERNAL_PLUGINS": "none"}),
        # the environment variable route keeps working, also with entry points off
        (WHICH, {"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": "skip_harness.integrations.verl"}))
    assert _rollout_tq(installed) == "skip_harness.integrations.verl"
    assert _rollout_tq(off) == "verl.utils.skip.rollout_skip"
    assert _rollout_tq(modules) == "skip_harness.integrations.verl"


def test_the_startup_line_says_once_how_verl_loaded_the_plugin(tmp_path):
    code = (
        "import logging, sys\n"
        "sys.path.insert(0, %r)\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
        "import verl_rig as rig\n"
        "from verl.utils.skip import SkipManager\n"
        "SkipManager.init(rig.compose(%r))\n"
        "SkipManager.skip_instances['rollout_tq'].close()\n"
    ) % (os.path.join(os.path.dirname(__file__)), str(tmp_path / "cache"))
    proc = _python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "serves verl's skip.rollout_tq" in line]
    assert len(lines) == 1 and "verl.plugins entry point; VERL_USE_EXTERNAL_PLUGINS=none turns it off" in lines[0], \
        proc.stdout[-3000:]


TRL_IMPORT = (
    "import verl, torch\n"
    "from transformers import AutoModelForCausalLM\n"
    "from verl.models.transformers.monkey_patch import apply_monkey_patch\n"
    "from skip_harness.demo.tiny_llama import save_tiny_llama\n"
    "model = AutoModelForCausalLM.from_pretrained(save_tiny_llama(%r))\n"
    "apply_monkey_patch(model, use_remove_padding=False)\n"   # verl's FSDP workers run this on every model
    "print('PATCHED')\n"
)


def test_verl_beside_current_trl_builds_its_model(tmp_path):
    """verl 0.9.x's monkey patch imports AutoModelForCausalLMWithValueHead whenever TRL is installed
    (verl/models/transformers/monkey_patch.py:352); TRL >= 1.13 has none: the plug-in supplies an empty one."""
    from importlib.metadata import version

    from packaging.version import Version

    trl = pytest.importorskip("trl")
    removed = Version(version("trl")) >= Version("1.13")
    runs = [(TRL_IMPORT % str(tmp_path / "model"), {})]
    if removed:
        runs.append((TRL_IMPORT % str(tmp_path / "model_without"), {"VERL_USE_EXTERNAL_PLUGINS": "none"}))
    with_plugin, *rest = _pythons(tmp_path, *runs)
    assert with_plugin.returncode == 0 and "PATCHED" in with_plugin.stdout, with_plugin.stderr[-3000:]
    if removed:
        (without,) = rest
        assert without.returncode != 0 and "AutoModelForCausalLMWithValueHead" in without.stderr, \
            (trl.__version__, without.stderr[-2000:])
