"""What computed a run's values: the machine a step's values were recorded on, and whether a replay runs
on the same one (`run.replay_check`, `cli.pairing`).

The same training step on the same rows gives the same bits only where the same kernels run with the same
reduction order: the same torch build, the same CPU code path (torch's CPU capability and the CPU model,
which pick MKL's and oneDNN's paths), the same number of intra-op threads (which split CPU reductions),
the same accelerator. A recording kept as a test and replayed on a CI machine with another CPU is the
case this is for: its values differ there by rounding noise (the committed demo pack, recorded on an
Intel Xeon VM, read `approx_kl` 7.0e-16 where an AMD EPYC VM computes 8.1e-15), which is no divergence.
So each step's values are stored with :func:`this_machine`, and a replay whose machine differs from the
recording's (:func:`difference`) is compared within rounding noise, as one at another K or W is
(`run.tolerance`); a recording that does not say (recorded before this was kept) is compared the same
way and the summary says the machine is unknown.

The accelerator is named only when this process already initialized CUDA: asking would create a CUDA
context (and take memory on a GPU) in a process that never uses one, such as verl's driver, whose
values are computed by its workers.
"""
from __future__ import annotations

import functools
import platform
from typing import Dict, Mapping, Optional

# What a machine is, by key, in the order the summary names them.
KEYS = ("torch", "cpu", "cpu_capability", "threads", "accelerator")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("model name", "Hardware", "cpu model"):
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


@functools.lru_cache(maxsize=1)
def _static() -> Dict[str, str]:
    import torch

    capability = "unknown"
    try:
        capability = str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - an older or unusual torch: the capability is simply not known
        pass
    return {"torch": str(torch.__version__), "cpu": _cpu_model(), "cpu_capability": capability}


def this_machine() -> Dict[str, str]:
    """This process's machine, as stored beside each step's values: torch's version, the CPU model, torch's
    CPU capability, its intra-op thread count and the CUDA device in use ('none' when CUDA is not in use)."""
    import torch

    accelerator = "none"
    if torch.cuda.is_initialized():
        try:
            accelerator = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
        except Exception:  # noqa: BLE001 - a CUDA error here says nothing about the values
            accelerator = "unknown"
    return {**_static(), "threads": str(torch.get_num_threads()), "accelerator": accelerator}


def as_machine(doc: object) -> Optional[Dict[str, str]]:
    """A stored machine document read back: its known keys as text, or None when it is absent or not one."""
    if not isinstance(doc, Mapping):
        return None
    out = {k: str(doc[k]) for k in KEYS if k in doc}
    return out or None


def difference(recorded: Optional[Mapping[str, str]], now: Mapping[str, str]) -> str:
    """'' when the values were recorded on this machine; else what differs, for a summary line:
    `torch 2.12.0+cpu -> 2.13.0+cpu, cpu Intel(R) Xeon(R) -> AMD EPYC`, or `the recording does not say
    which machine computed its values` for values recorded before machines were kept."""
    if recorded is None:
        return "the recording does not say which machine computed its values"
    parts = [f"{k} {recorded.get(k, 'unknown')} -> {now.get(k, 'unknown')}" for k in KEYS
             if recorded.get(k) != now.get(k) and (k in recorded or k in now)]
    return ", ".join(parts)


def describe(machine: Optional[Mapping[str, str]]) -> str:
    """One machine in words: `AMD EPYC (AVX2), torch 2.13.0+cpu, 2 threads`."""
    if not machine:
        return "unknown"
    text = f"{machine.get('cpu', 'unknown')} ({machine.get('cpu_capability', 'unknown')}), torch {machine.get('torch', '?')}"
    text += f", {machine.get('threads', '?')} threads"
    if machine.get("accelerator", "none") != "none":
        text += f", {machine['accelerator']}"
    return text


__all__ = ["KEYS", "as_machine", "describe", "difference", "this_machine"]
