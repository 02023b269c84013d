"""Training on the step engine: train state, loss, the donated step, the replaying loop, orbax checkpoints."""

from .checkpoints import TrainCheckpoints
from .evaluation import Evaluator
from .logprobs import sequence_logprobs
from .loop import TrainLoop
from .loss import chunked_cross_entropy, default_labels, shift_labels
from .schedules import learning_rate_schedule
from .state import TrainState, abstract_train_state, init_train_state, train_state_shardings
from .step import TrainStep, TrainStepOptions, make_train_step
from .trainable import TrainableParameters, freezing, resolve_trainable

__all__ = [
    "Evaluator", "TrainCheckpoints", "TrainLoop", "TrainState", "TrainStep", "TrainStepOptions", "abstract_train_state",
    "chunked_cross_entropy", "default_labels", "init_train_state", "learning_rate_schedule", "make_train_step",
    "sequence_logprobs", "shift_labels",
    "train_state_shardings", "TrainableParameters", "freezing", "resolve_trainable",
]
