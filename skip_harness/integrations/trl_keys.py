"""How a TRL ``GRPOTrainer``'s generations are keyed: K from TRL's arguments, the digest of a generation
call's prompts, the generation fingerprint, the training-side config recorded beside it, and the namespace.
Pure functions of the trainer's arguments and model config; :mod:`skip_harness.integrations.trl` uses them."""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import struct
from typing import Any, Dict, Mapping, Optional, Sequence

import torch

from skip_harness.errors import ConfigError

#: GRPOConfig fields that shape what the generator samples (apart from the policy's weights).
GENERATION_ARGS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_length",
    "num_generations", "generation_batch_size", "generation_kwargs", "cache_implementation",
    "use_vllm", "vllm_mode", "use_transformers_continuous_batching", "seed",
)


# --------------------------------------------------------------------------- K
def generations_per_step(args: Any) -> int:
    """K: how many generation calls one optimizer step makes, from TRL's own arguments.

    TRL generates once every ``steps_per_generation * num_iterations`` micro-steps (``self._step``)
    and an optimizer step has ``gradient_accumulation_steps`` micro-steps. So K is
    ``gradient_accumulation_steps / (steps_per_generation * num_iterations)`` when that divides, and 1
    when a generation spans several optimizer steps (``num_iterations > 1`` or ``steps_per_generation``
    a multiple of the accumulation): then only every n-th optimizer step generates, and only those
    steps are cached. Any other combination makes the count vary from step to step: refused.
    """
    accumulation = int(args.gradient_accumulation_steps)
    every = int(args.steps_per_generation) * int(getattr(args, "num_iterations", 1) or 1)
    if accumulation % every == 0:
        return accumulation // every
    if every % accumulation == 0:
        return 1
    raise ConfigError(
        "GRPOConfig.steps_per_generation",
        f"gradient_accumulation_steps = {accumulation} and steps_per_generation x num_iterations = {every} "
        "make the number of generations per optimizer step vary; skip_harness caches a fixed K per step: "
        "choose values where one divides the other",
    )


# --------------------------------------------------------------------------- digests
def _update(h: "hashlib._Hash", obj: Any) -> None:
    """Feed a stable, type-tagged encoding of `obj` into `h` (lists of token ids, tensors, images...)."""
    if obj is None:
        h.update(b"N")
    elif isinstance(obj, bool):
        h.update(b"B1" if obj else b"B0")
    elif isinstance(obj, int):
        h.update(b"I" + str(obj).encode() + b";")
    elif isinstance(obj, float):
        h.update(b"F" + struct.pack("<d", obj))
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        h.update(b"S" + str(len(data)).encode() + b":" + data)
    elif isinstance(obj, (bytes, bytearray)):
        h.update(b"Y" + str(len(obj)).encode() + b":" + bytes(obj))
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(b"T" + str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, Mapping):
        h.update(b"D" + str(len(obj)).encode())
        for key in sorted(obj, key=str):
            _update(h, str(key))
            _update(h, obj[key])
    elif isinstance(obj, (list, tuple)):
        if obj and all(type(x) is int for x in obj):  # a row of token ids: one pass, no recursion
            h.update(b"L" + str(len(obj)).encode() + b"i" + ",".join(map(str, obj)).encode())
            return
        h.update(b"L" + str(len(obj)).encode())
        for item in obj:
            _update(h, item)
    elif hasattr(obj, "tobytes") and hasattr(obj, "size") and hasattr(obj, "mode"):  # a PIL image
        h.update(b"P" + str(obj.mode).encode() + str(obj.size).encode() + obj.tobytes())
    elif hasattr(obj, "tobytes") and hasattr(obj, "dtype") and hasattr(obj, "shape"):  # a NumPy array
        h.update(b"A" + str(obj.dtype).encode() + str(tuple(obj.shape)).encode() + obj.tobytes())
    else:
        h.update(b"R" + repr(obj).encode())


def digest(obj: Any) -> str:
    """A short stable hex digest of plain data, tensors and images."""
    h = hashlib.sha256()
    _update(h, obj)
    return h.hexdigest()[:24]


def prompt_digest(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """The digest of one generation call's inputs: prompt token ids, images, multimodal fields.

    ``_generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, ...)``."""
    names = ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images")
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    return digest([bound.get(name) for name in names[:4]])


# --------------------------------------------------------------------------- fingerprint
def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value, sort_keys=True, allow_nan=False)
        return value
    except (TypeError, ValueError):
        return repr(value)


def generation_fingerprint(trainer: Any) -> Dict[str, Any]:
    """The values that shape a GRPOTrainer's rollouts apart from the policy's learned weights."""
    args = trainer.args
    values: Dict[str, Any] = {f"trl.{name}": _jsonable(getattr(args, name, None)) for name in GENERATION_ARGS}
    model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
    config = getattr(model, "config", None)
    if config is not None:
        raw = config.to_dict()
        name = raw.pop("_name_or_path", None) or getattr(config, "name_or_path", None)
        raw.pop("transformers_version", None)
        values["model.name_or_path"] = str(name) if name is not None else None
        values["model.config"] = digest(json.dumps(raw, sort_keys=True, default=str))
    generation_config = getattr(trainer, "generation_config", None)
    if generation_config is not None and hasattr(generation_config, "to_dict"):
        gen = generation_config.to_dict()
        gen.pop("transformers_version", None)
        values["trl.generation_config"] = digest(json.dumps(gen, sort_keys=True, default=str))
    values["trl.eos_token_ids"] = _jsonable(list(getattr(trainer, "eos_token_ids", []) or []))
    return values


#: TrainingArguments fields that say where and how a run reports, not what it trains: left out of the
#: training-side config recorded with each step's values (a replay names the training keys that changed).
NOT_TRAINING_ARGS = (
    "output_dir", "logging_dir", "run_name", "report_to", "push_to_hub", "disable_tqdm", "overwrite_output_dir",
    "hub_*", "logging_*", "save_*", "eval_*", "log_*", "dataloader_*", "ddp_*", "resume_from_checkpoint",
    "local_rank", "tpu_*", "deepspeed", "accelerator_config", "fsdp*", "full_determinism", "skip_memory_metrics",
)


def training_config(trainer: Any) -> Dict[str, Any]:
    """The training side of a GRPOTrainer's arguments (``trl.<name>``): what the generation fingerprint
    leaves out, less where the run writes and reports (`NOT_TRAINING_ARGS`)."""
    raw = trainer.args.to_dict() if hasattr(trainer.args, "to_dict") else dict(vars(trainer.args))
    return {f"trl.{name}": _jsonable(value) for name, value in sorted(raw.items())
            if name not in GENERATION_ARGS and not any(fnmatch.fnmatchcase(name, p) for p in NOT_TRAINING_ARGS)}


def namespace_for(trainer: Any, experiment_name: str, project_name: str, K: int) -> Dict[str, Any]:
    """The namespace: experiment, project, K and the shape values TRL has."""
    args = trainer.args
    n = int(args.num_generations)
    return {
        "experiment_name": experiment_name,
        "project_name": project_name,
        "K": K,
        "n": n,
        # prompts per optimizer step that generates (global), as verl's data.train_batch_size
        "train_batch_size": K * int(args.generation_batch_size) // n,
        "max_response_length": int(args.max_completion_length),
    }


def run_settings(trainer: Any, *, dump_dir: Optional[str] = None, experiment_name: Optional[str] = None,
                 project_name: str = "trl", fingerprint: Optional[Mapping[str, Any]] = None,
                 settings: Optional[Mapping[str, Any]] = None) -> Any:
    """TRL's adapter: a GRPOTrainer's run settings (`run.settings.RunSettings`), resolved once by `attach`: K
    from its arguments, the namespace (`experiment_name` defaults to ``args.run_name``, else the output
    directory's name), the generation fingerprint plus `fingerprint`, the training side, and `settings`
    (``skip.rollout_tq`` keys; ``enable`` and ``restore_rng`` default to True)."""
    from skip_harness.run.settings import from_parts

    K = generations_per_step(trainer.args)
    if experiment_name is None:
        experiment_name = getattr(trainer.args, "run_name", None) or os.path.basename(
            os.path.normpath(str(trainer.args.output_dir)))
    values = generation_fingerprint(trainer)
    values.update(dict(fingerprint or {}))
    config = {"enable": True, "restore_rng": True, **dict(settings or {})}
    if dump_dir is not None:
        config["dump_dir"] = str(dump_dir)
    return from_parts(config, namespace=namespace_for(trainer, experiment_name, project_name, K), fingerprint=values,
                      training_config=training_config(trainer))
