"""How a cached verl mini-batch is mapped onto this run's prompt uids (pure: no verl, no Ray)."""
from __future__ import annotations

import pytest

from skip_harness.errors import HarnessUsageError
from skip_harness.integrations.verl_tq import plan_injection, prompt_uid


def payload(keys, step=3):
    return {"keys": keys, "tags": [{"status": "success", "global_steps": step, "min_global_steps": step,
                                    "max_global_steps": step, "seq_len": i} for i, _ in enumerate(keys)],
            "tensordict": None, "global_steps": step}


def test_groups_map_in_order_of_first_appearance_and_keep_session_and_index():
    cached = payload(["b_0_0", "a_0_0", "b_1_0", "a_1_0", "a_1_1"])
    plan = plan_injection(cached, ["X", "Y"], 3, rewrite_steps=False)
    assert plan.keys == ["X_0_0", "Y_0_0", "X_1_0", "Y_1_0", "Y_1_1"]   # recorded order, suffixes kept
    assert plan.uids == ["X", "Y", "X", "Y", "Y"]
    assert plan.tags == cached["tags"] and plan.tags is not cached["tags"]
    assert plan.prompts == ["X", "Y"] and plan.prompt_status == ["finished", "finished"]
    assert [prompt_uid(k) for k in plan.keys] == plan.uids


def test_served_for_another_step_the_staleness_tags_name_this_step():
    plan = plan_injection(payload(["a_0_0"], step=2), ["X"], 7, rewrite_steps=True)
    assert plan.tags[0]["global_steps"] == plan.tags[0]["min_global_steps"] == plan.tags[0]["max_global_steps"] == 7
    assert plan.tags[0]["seq_len"] == 0


def test_a_prompt_with_no_recorded_trajectory_is_a_failed_group():
    plan = plan_injection(payload(["a_0_0", "a_1_0"]), ["X", "Y"], 3, rewrite_steps=False)
    assert plan.prompt_status == ["finished", "failure"]


def test_more_groups_than_prompts_is_refused_naming_the_step():
    with pytest.raises(HarnessUsageError, match="step 3: the cached mini-batch holds 2 prompt groups"):
        plan_injection(payload(["a_0_0", "b_0_0"]), ["X"], 3, rewrite_steps=False)
