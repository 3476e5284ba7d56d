"""The demo: GRPO on a toy sort task with a small CPU transformer, in verl's three trainer modes."""
from skip_harness.demo.policy import Policy, PolicyConfig
from skip_harness.demo.task import SortTask
from skip_harness.demo.trainer import DemoSettings, DemoTrainer

# The smallest demo run worth checking end to end (Hydra overrides for scripts/train.py): a one-layer
# d_model-32 policy, 8 prompts of 6 tokens, n = 2, no validation, no progress bar.
TINY_OVERRIDES = (
    "trainer.progress=false",
    "trainer.test_freq=0",
    "data.train_batch_size=8",
    "data.max_prompt_length=6",
    "data.max_response_length=6",
    "data.val_batch_size=8",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.model.d_model=32",
    "actor_rollout_ref.model.n_layers=1",
)

__all__ = ["DemoSettings", "DemoTrainer", "Policy", "PolicyConfig", "SortTask", "TINY_OVERRIDES"]
