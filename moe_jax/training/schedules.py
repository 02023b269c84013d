"""Learning-rate schedules by name, as Transformers' Trainer shapes them (optax schedules underneath).

    schedule = learning_rate_schedule("cosine", 3e-4, total_steps=1000, warmup_steps=50, min_lr_ratio=0.1)
    build_optimizer("adamw", schedule)                # optax takes the schedule where it takes a rate
    schedule(0), schedule(50), schedule(999)          # the rate of optimizer updates 1, 51 and 1000

Every schedule warms up linearly from 0 over `warmup_steps` updates (Transformers' `lr * step / warmup`), then:
    constant  stays at the peak
    cosine    follows half a cosine from the peak to `min_lr_ratio * peak` at `total_steps`
              (`get_cosine_with_min_lr_schedule_with_warmup`; min_lr_ratio 0 is `get_cosine_schedule_with_warmup`)
    linear    falls linearly to `min_lr_ratio * peak` at `total_steps` (`get_linear_schedule_with_warmup` at 0)
The schedule is indexed by the optimizer's update count, which lives in the optimizer state: a resumed run and
a replayed step see the rate they would have seen.
"""

from __future__ import annotations

from collections.abc import Callable

import optax

Schedule = Callable[[int], float]


def _after_warmup(decay: Callable[[float, float, int], Schedule]) -> Callable[..., Schedule]:
    def build(peak: float, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> Schedule:
        warmup = optax.linear_schedule(0.0, peak, warmup_steps)
        rest = decay(peak, peak * min_lr_ratio, total_steps - warmup_steps)
        return optax.join_schedules([warmup, rest], [warmup_steps]) if warmup_steps else rest
    return build


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "constant": _after_warmup(lambda peak, end, steps: optax.constant_schedule(peak)),
    "cosine": _after_warmup(lambda peak, end, steps: optax.cosine_decay_schedule(peak, steps, end / peak)),
    "linear": _after_warmup(lambda peak, end, steps: optax.linear_schedule(peak, end, steps)),
}


def learning_rate_schedule(name: str, learning_rate: float, total_steps: int | None = None, *,
                           warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> Schedule:
    """The schedule `name` (one of `SCHEDULES`) peaking at `learning_rate`; `total_steps`: the optimizer updates
    of the whole run (needed by every schedule but a constant one without warmup)."""
    if name not in SCHEDULES:
        raise ValueError(f"learning-rate schedule {name!r} is not one of {sorted(SCHEDULES)}.")
    if learning_rate <= 0:
        raise ValueError(f"learning rate {learning_rate} must be > 0.")
    if warmup_steps < 0:
        raise ValueError(f"warmup steps {warmup_steps} must be >= 0.")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio {min_lr_ratio} must be in [0, 1] (the final rate over the peak).")
    if name == "constant" and min_lr_ratio:
        raise ValueError(f"min_lr_ratio {min_lr_ratio} needs a decaying schedule (cosine or linear); a constant "
                         "schedule stays at the peak.")
    if total_steps is None:
        if name != "constant" or warmup_steps:
            raise ValueError(f"the {name} schedule{' with warmup' if warmup_steps else ''} needs the run's total "
                             "steps.")
        return optax.constant_schedule(learning_rate)
    if warmup_steps >= total_steps and (name != "constant" or warmup_steps > total_steps):
        raise ValueError(f"{warmup_steps} warmup steps leave nothing of a {total_steps}-step run to "
                         f"{'decay' if name != 'constant' else 'train at the peak'}; use fewer warmup steps.")
    return SCHEDULES[name](learning_rate, total_steps, warmup_steps, min_lr_ratio)
