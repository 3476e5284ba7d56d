"""The demo: GRPO on a toy sort task with a small CPU transformer, in verl's three trainer modes."""
from .policy import Policy, PolicyConfig
from .task import SortTask
from .trainer import MODES, DemoSettings, DemoTrainer

__all__ = ["MODES", "DemoSettings", "DemoTrainer", "Policy", "PolicyConfig", "SortTask"]
