"""The demo: GRPO on a toy sort task with a small CPU transformer, in verl's three trainer modes."""
from .policy import Policy, PolicyConfig
from .task import SortTask
from .trainer import DemoSettings, DemoTrainer

__all__ = ["DemoSettings", "DemoTrainer", "Policy", "PolicyConfig", "SortTask"]
