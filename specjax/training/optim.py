"""The optimizer: global-norm clipping, then AdamW on a linear warm-up + cosine decay schedule.

Steps are counted from 1: ``schedule(s)`` is the learning rate of the update that completes step s, rising
linearly to ``learning_rate`` at s = warmup_steps and decaying along a cosine to
``end_lr_ratio · learning_rate`` at s = total_steps.  A train step that keeps the completed-step count in its
state logs ``schedule(state["step"])`` after the update (see ``loop.py``).
"""
from __future__ import annotations

from typing import Any, Callable

import optax

from specjax.errors import SpecjaxError


def _check(learning_rate, total_steps, warmup_steps, end_lr_ratio):
  if not isinstance(total_steps, int) or total_steps < 1:
    raise SpecjaxError(f"total_steps must be an integer >= 1, got {total_steps!r}")
  if not isinstance(warmup_steps, int) or not 0 <= warmup_steps < total_steps:
    raise SpecjaxError(f"warmup_steps must be an integer in [0, total_steps={total_steps}), got {warmup_steps!r}")
  if not learning_rate > 0:
    raise SpecjaxError(f"learning_rate must be > 0, got {learning_rate!r}")
  if not 0.0 <= end_lr_ratio <= 1.0:
    raise SpecjaxError(f"end_lr_ratio must be in [0, 1], got {end_lr_ratio!r}")


def make_schedule(*, learning_rate: float, total_steps: int, warmup_steps: int,
                  end_lr_ratio: float = 0.1) -> Callable[[Any], Any]:
  """step (1-based, int or int array) -> learning rate; jit-able."""
  _check(learning_rate, total_steps, warmup_steps, end_lr_ratio)
  return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
                                            decay_steps=total_steps, end_value=learning_rate * end_lr_ratio)


def learning_rate_at(step: int, *, learning_rate: float, total_steps: int, warmup_steps: int,
                     end_lr_ratio: float = 0.1) -> float:
  """The learning rate of the update that completes ``step`` (1-based), as a float."""
  return float(make_schedule(learning_rate=learning_rate, total_steps=total_steps, warmup_steps=warmup_steps,
                             end_lr_ratio=end_lr_ratio)(step))


def make_optimizer(*, learning_rate: float, total_steps: int, warmup_steps: int, weight_decay: float = 0.0,
                   clip_norm: float | None = 1.0, end_lr_ratio: float = 0.1, b1: float = 0.9, b2: float = 0.95,
                   weight_decay_mask: Any = None) -> optax.GradientTransformation:
  """Clip by global norm (``clip_norm`` None: no clipping), then AdamW on ``make_schedule``'s learning rate.

  ``weight_decay_mask``: optax's ``mask`` for AdamW (a pytree of bools or a function of the params), e.g. to
  leave norms and biases undecayed.
  """
  schedule = make_schedule(learning_rate=learning_rate, total_steps=total_steps, warmup_steps=warmup_steps,
                           end_lr_ratio=end_lr_ratio)
  if weight_decay < 0:
    raise SpecjaxError(f"weight_decay must be >= 0, got {weight_decay!r}")
  if clip_norm is not None and not clip_norm > 0:
    raise SpecjaxError(f"clip_norm must be > 0 (or None for no clipping), got {clip_norm!r}")
  if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
    raise SpecjaxError(f"Adam betas must be in [0, 1), got b1={b1!r}, b2={b2!r}")
  # optax counts updates from 0; update number c completes step c + 1.
  adamw = optax.adamw(lambda count: schedule(count + 1), b1=b1, b2=b2, weight_decay=weight_decay,
                      mask=weight_decay_mask)
  if clip_norm is None:
    return adamw
  return optax.chain(optax.clip_by_global_norm(clip_norm), adamw)
