"""verl's TransferQueue side of the plug-in: what one sampled mini-batch is, and how a cached one is put back.

A mini-batch is what verl's ``ReplayBuffer.sample`` selected, read from TransferQueue exactly as verl's
own ``RolloutTqSkip.prepare_data`` reads it, in the same shape verl's ``tq_batch.pt`` has::

    {"tensordict": TensorDict (jagged nested tensors, NonTensorStack fields), "keys": [...],
     "tags": [...], "global_steps": int}

On a hit it is put back into TransferQueue the way verl's agent loop puts a finished group
(``kv_batch_put`` of the trajectories with their tags, then each prompt's status ``finished``), so
verl's real sampler selects it: the i-th mini-batch right before the i-th ``sample`` call, so each
call selects exactly the groups it selected when it was recorded, in the recorded order. Only the
prompt uid changes: verl draws a fresh uuid4 per prompt each run, so the recorded groups are mapped,
in order, onto this run's uids -- in the keys (``{uid}_{session}_{index}``) and in the ``uid`` field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

from skip_harness.errors import HarnessUsageError

PARTITION = "train"


def read_minibatch(batch: Any, step: int) -> Dict[str, Any]:
    """The mini-batch verl's sampler returned (a ``KVBatchMeta``), read from TransferQueue."""
    import transfer_queue as tq

    keys = list(batch.keys)
    data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id)
    return {"tensordict": data, "tags": [dict(t) for t in batch.tags], "keys": keys, "global_steps": int(step)}


def prompt_uid(key: str) -> str:
    """The prompt uid of a trajectory key ``{uid}_{session_id}_{index}`` (verl's uids have no '_')."""
    return key.split("_", 1)[0]


@dataclass(frozen=True)
class Injection:
    keys: List[str]
    tags: List[Dict[str, Any]]
    uids: List[str]                 # per trajectory: the new prompt uid (the `uid` field)
    prompts: List[str]              # this mini-batch's prompt uids, in order
    prompt_status: List[str]        # 'finished', or 'failure' for a prompt with no recorded trajectory


def plan_injection(payload: Dict[str, Any], new_uids: Sequence[str], step: int, *, rewrite_steps: bool) -> Injection:
    """Map the recorded groups (in order of first appearance) onto `new_uids` (in order). `rewrite_steps`:
    the tags' global_steps / min_global_steps / max_global_steps become `step` (served from another step)."""
    keys = [str(k) for k in payload["keys"]]
    tags = payload["tags"]
    if len(tags) != len(keys):
        raise HarnessUsageError(f"cached mini-batch: {len(keys)} keys but {len(tags)} tags")
    order: Dict[str, int] = {}
    for key in keys:
        order.setdefault(prompt_uid(key), len(order))
    if len(order) > len(new_uids):
        raise HarnessUsageError(
            f"step {step}: the cached mini-batch holds {len(order)} prompt groups but this sample call takes "
            f"{len(new_uids)} prompts (data.train_batch_size / K changed since it was recorded?)")
    mapping = {old: new_uids[i] for old, i in order.items()}
    out_keys, out_tags, out_uids = [], [], []
    for key, tag in zip(keys, tags):
        old, _, rest = key.partition("_")
        new = mapping[old]
        out_keys.append(f"{new}_{rest}" if rest else new)
        out_uids.append(new)
        tag = dict(tag)
        if rewrite_steps:
            for name in ("global_steps", "min_global_steps", "max_global_steps"):
                if name in tag:
                    tag[name] = int(step)
        out_tags.append(tag)
    prompts = list(new_uids)
    status = ["finished" if i < len(order) else "failure" for i in range(len(prompts))]
    return Injection(out_keys, out_tags, out_uids, prompts, status)


def clear_partition() -> int:
    """Remove every key (prompts and trajectories) of the training partition, before a served step puts its
    recorded mini-batch in: groups left there -- restored from verl's checkpoint on a resume, or left over
    from an uncached step -- would otherwise be sampled first (verl's sampler prefers older prompts).
    Returns the number of keys removed."""
    import transfer_queue as tq

    items = (tq.kv_list(PARTITION) or {}).get(PARTITION, {})
    if items:
        tq.kv_clear(keys=list(items), partition_id=PARTITION)
    return len(items)


def inject(payload: Dict[str, Any], new_uids: Sequence[str], step: int, *, rewrite_steps: bool) -> int:
    """Put a cached mini-batch into TransferQueue for `new_uids` (this sample call's prompts). Returns
    the number of trajectories put."""
    import transfer_queue as tq
    from verl.utils import tensordict_utils as tu

    plan = plan_injection(payload, new_uids, step, rewrite_steps=rewrite_steps)
    fields = payload["tensordict"]
    if plan.keys:
        if "uid" in fields.keys():
            tu.assign_non_tensor_stack(fields, "uid", list(plan.uids))
        tq.kv_batch_put(keys=plan.keys, fields=fields, tags=plan.tags, partition_id=PARTITION)
    # the prompts last: verl's sampler never sees a finished prompt without its trajectories
    tq.kv_batch_put(
        keys=plan.prompts,
        partition_id=PARTITION,
        tags=[{"is_prompt": True, "status": s, "global_steps": int(step)} for s in plan.prompt_status],
    )
    return len(plan.keys)
