"""Training-loop integration: the complete training state and when to checkpoint it.

TrainState
    A DCP ``Stateful`` bundle of model(s), optimizer(s), LR scheduler(s), GradScaler, every rank's RNG
    states, every rank's dataloader progress, step, epoch and a JSON-able ``extra`` dict.
CheckpointManager
    Saves a TrainState on a step cadence (optionally in the background), applies retention, and resumes
    from the newest intact checkpoint, falling back past damaged ones.
"""

from .manager import CheckpointManager
from .state import TrainState

__all__ = ["CheckpointManager", "TrainState"]
