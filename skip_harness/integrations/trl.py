"""Attach skip_harness to a TRL ``GRPOTrainer`` in one call.

    from skip_harness.integrations.trl import attach

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    harness = attach(trainer, dump_dir="/tmp/rollouts", experiment_name="my-run")
    trainer.train()              # first run: generates and caches; a rerun: served from the cache
    print(harness.summary())

What is cached
    The return of ``GRPOTrainer._generate_single_turn``: the completion token ids of one generation
    call and, where the generator returns them (vLLM), the sampling log-probs. Nothing downstream of
    it is cached: decoding, rewards, advantages, the log-probs under the current weights, the
    reference model's log-probs, the loss and every logged metric are recomputed on a replay. So a
    replay may change the training side (learning rate, ``beta``, loss type, clipping, reward
    weighting): it then trains on the recorded completions, which is what the cache is for. It is
    stored as tensors (flat ids, per-completion lengths, flat log-probs when there are any) and
    handed back to TRL as the exact lists the generator returned.

How it is keyed
    step = ``trainer.state.global_step`` (the optimizer step, 0-based: ``first_step=0``), inner
    index = the generation call's position within that step, rank = the process. K, the number of
    generation calls per optimizer step, comes from TRL's arguments (:func:`generations_per_step`).
    Evaluation generation (the model in eval mode) is never cached. Each call's prompts (token ids,
    plus any images and multimodal fields) are digested: a replay whose prompts for a step differ
    from the recorded ones regenerates that step, with a WARNING naming it.

Fingerprint
    TRL's generation arguments, the seed, the generation backend, the model's name and a digest of
    its config (:func:`generation_fingerprint`). Learning rate, ``beta`` and other training-side
    arguments are left out on purpose. Prompts are checked per generation call (above) rather than
    per namespace, so changing one prompt regenerates only the steps that see it.

RNG
    TRL samples from the global generators, so ``restore_rng`` is on: the generators' states after
    each generation are recorded and restored on a hit, and a hit leaves the process as a miss would.

Lifecycle
    :func:`attach` starts the harness when training begins (lock, scan, cleanup, fingerprint check)
    and closes it when training ends, giving the trainer its own method back; the returned harness
    keeps its summary and outcomes. Not supported: tools / environments (a generation then makes a
    variable number of generator calls) and ``rollout_func``; :func:`attach` refuses them.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

import torch

from skip_harness.errors import ConfigError, HarnessUsageError, ReplayDivergedError

log = logging.getLogger("skip_harness")

#: The GRPOTrainer method whose result is cached: the narrowest one returning all a generation produced.
GENERATION_METHOD = "_generate_single_turn"

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
    import fnmatch

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


# --------------------------------------------------------------------------- payload
class _Generation:
    """Stands in for ``trainer._generate_single_turn`` so the harness caches compact tensors.

    `generate` is what the harness wraps: it calls TRL's method and returns its result as a dict of
    tensors; `decode` turns that (fresh or served from the cache) back into TRL's return value.
    """

    def __init__(self, original: Callable[..., Any]):
        self._original = original

    def generate(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        return encode_generation(self._original(*args, **kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return decode_generation(self.generate(*args, **kwargs))


def _int_rows(rows: Any) -> bool:
    return isinstance(rows, list) and all(
        isinstance(r, list) and all(type(x) is int for x in r) for r in rows
    )


def _float_rows(rows: Any, lengths: Sequence[int]) -> bool:
    return isinstance(rows, list) and len(rows) == len(lengths) and all(
        isinstance(r, list) and len(r) == n and all(x is None or type(x) is float for x in r)
        for r, n in zip(rows, lengths)
    )


def encode_generation(out: Any) -> Dict[str, Any]:
    """TRL's ``(completion_ids, logprobs)`` as tensors; anything else is kept as it is (``raw``)."""
    if isinstance(out, tuple) and len(out) == 2 and _int_rows(out[0]):
        completion_ids, logprobs = out
        lengths = [len(r) for r in completion_ids]
        if logprobs is None or _float_rows(logprobs, lengths):
            flat = [x for r in completion_ids for x in r]
            payload: Dict[str, Any] = {
                "completion_ids": torch.tensor(flat, dtype=torch.int64),
                "lengths": torch.tensor(lengths, dtype=torch.int64),
                "logprobs": None,
                "logprob_is_none": None,
            }
            if logprobs is not None:
                values = [x for r in logprobs for x in r]
                payload["logprobs"] = torch.tensor(
                    [float("nan") if x is None else x for x in values], dtype=torch.float64
                )
                if any(x is None for x in values):
                    payload["logprob_is_none"] = torch.tensor([x is None for x in values], dtype=torch.bool)
            return payload
    return {"raw": out}


def decode_generation(payload: Mapping[str, Any]) -> Any:
    """The inverse of :func:`encode_generation`: exactly the lists TRL's generator returned."""
    if "raw" in payload:
        return payload["raw"]
    lengths = [int(n) for n in payload["lengths"].tolist()]
    flat = payload["completion_ids"].tolist()
    completion_ids, offset = [], 0
    for n in lengths:
        completion_ids.append(flat[offset:offset + n])
        offset += n
    logprobs = None
    if payload.get("logprobs") is not None:
        values = payload["logprobs"].tolist()
        if payload.get("logprob_is_none") is not None:
            values = [None if none else v for v, none in zip(values, payload["logprob_is_none"].tolist())]
        logprobs, offset = [], 0
        for n in lengths:
            logprobs.append(values[offset:offset + n])
            offset += n
    return completion_ids, logprobs


# --------------------------------------------------------------------------- attach
def _check_supported(trainer: Any) -> None:
    if getattr(trainer, "rollout_func", None) is not None:
        raise HarnessUsageError(
            "skip_harness.integrations.trl: GRPOTrainer(rollout_func=...) is not supported: a custom rollout "
            "function returns more than the generator's completions; cache it with SkipHarness.wrap directly"
        )
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
        raise HarnessUsageError(
            "skip_harness.integrations.trl: GRPOTrainer with tools or environments is not supported: one "
            "generation then makes a variable number of generator calls"
        )
    if GENERATION_METHOD in getattr(trainer, "__dict__", {}):
        raise HarnessUsageError(
            f"skip_harness.integrations.trl: trainer.{GENERATION_METHOD} is already replaced on this trainer "
            "(attach() called twice?)"
        )


def attach(
    trainer: Any,
    *,
    dump_dir: Optional[str] = None,
    experiment_name: Optional[str] = None,
    project_name: str = "trl",
    callbacks: Sequence[Any] = (),
    fingerprint: Optional[Mapping[str, Any]] = None,
    **settings: Any,
) -> Any:
    """Cache every generation of a TRL ``GRPOTrainer``; returns the :class:`SkipHarness`.

    `dump_dir`: the cache root (default: ``SKIP_HARNESS_DUMP_DIR`` or a per-user cache directory).
    `experiment_name` (default: ``args.run_name``, else the output directory's name) and
    `project_name` name the namespace. `settings`: any other ``skip.rollout_tq`` setting
    (``action="repeat"``, ``on_mismatch="regenerate"``, ``steps=[0, 1]``, ``enable=False`` ...);
    ``restore_rng`` defaults to True. `fingerprint`: extra values to add to the generation
    fingerprint (a reward-free data version, say). Call before ``trainer.train()``.
    """
    from transformers import TrainerCallback

    from skip_harness.run.harness import SkipHarness

    _check_supported(trainer)
    K = generations_per_step(trainer.args)
    if experiment_name is None:
        experiment_name = getattr(trainer.args, "run_name", None) or os.path.basename(
            os.path.normpath(str(trainer.args.output_dir))
        )
    values = generation_fingerprint(trainer)
    values.update(dict(fingerprint or {}))
    config = {"enable": True, "restore_rng": True, **settings}
    if dump_dir is not None:
        config["dump_dir"] = str(dump_dir)
    harness = SkipHarness.create(
        settings=config,
        namespace=namespace_for(trainer, experiment_name, project_name, K),
        fingerprint=values,
        callbacks=callbacks,
        training_config=training_config(trainer),
    )

    original = getattr(trainer, GENERATION_METHOD)
    generation = _Generation(original)
    harness.wrap(
        generation,
        sample="generate",
        prepare_data=None,
        step_of=lambda: trainer.state.global_step,
        first_step=0,
        is_validation=lambda args, kwargs: not trainer.model.training,
        call_digest=prompt_digest,
    )
    setattr(trainer, GENERATION_METHOD, generation)

    def detach() -> None:
        if trainer.__dict__.get(GENERATION_METHOD) is generation:
            del trainer.__dict__[GENERATION_METHOD]
        harness.unwrap()

    class _Lifecycle(TrainerCallback):
        """Starts the harness with training, closes it (and gives TRL its method back) at the end.

        It stays registered but inert afterwards: a later ``train()`` runs TRL untouched (attach again
        to cache it)."""

        done = False

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not self.done:
                harness.start()

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            # the log_history entry of an optimizer step (not the end-of-training totals, not an evaluation):
            # recorded with, or checked against, the generation step it trained on (global_step - 1)
            if self.done or not logs or "loss" not in logs or "train_runtime" in logs:
                return
            try:
                harness.observe(state.global_step - 1, **logs)
            except ReplayDivergedError:       # replay_check=error: the run stops here, closed and reported
                self.done = True
                try:
                    harness.close()
                finally:
                    detach()
                raise

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.done:
                return
            self.done = True
            try:
                harness.close()
            finally:
                detach()

    trainer.add_callback(_Lifecycle())
    if getattr(getattr(trainer, "accelerator", None), "is_main_process", True):
        log.info(
            "caching GRPOTrainer generations: K = %d generation call(s) per optimizer step (gradient_accumulation_steps"
            " = %s, steps_per_generation = %s, num_iterations = %s), experiment %r",
            K, trainer.args.gradient_accumulation_steps, trainer.args.steps_per_generation,
            getattr(trainer.args, "num_iterations", 1), experiment_name,
        )
    return harness
