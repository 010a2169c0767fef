"""Real optimizers for verification runs: the builders live beneath the planner's probe and
the runners alike (planner.probe.optimizers), so both build the same optimizer state."""

from planner.probe.optimizers import (LEARNING_RATE, WEIGHT_DECAY, build_optimizer,  # noqa: F401
                                      decay_parameter_groups, reset_bitsandbytes_overrides)
