"""How training is spread over several devices: the strategy enum and the plan (devices,
strategy, local SGD period), validated once.

Names follow what users type in Accelerate and DeepSpeed configurations:
- ddp: torch DistributedDataParallel (`accelerate launch --multi_gpu`): a full replica per
  device, gradients all-reduced in buckets.
- zero1 / zero2 / zero3: DeepSpeed ZeRO stages: optimizer state sharded (1), and the
  gradients (2), and the parameters (3).
- fsdp-full-shard / fsdp-shard-grad-op: torch FSDP2 `fully_shard` as Accelerate's FSDP
  plugin applies it, with `reshard_after_forward` True (FULL_SHARD) or False
  (SHARD_GRAD_OP).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from planner.errors import PlannerInputError

MAX_DEVICES = 4096


class Strategy(enum.Enum):
    SINGLE = "single"  # one device, nothing crosses a network
    DDP = "ddp"
    ZERO1 = "zero1"
    ZERO2 = "zero2"
    ZERO3 = "zero3"
    FSDP_FULL_SHARD = "fsdp-full-shard"
    FSDP_SHARD_GRAD_OP = "fsdp-shard-grad-op"

    @property
    def shards_parameters(self) -> bool:
        return self in (Strategy.ZERO3, Strategy.FSDP_FULL_SHARD, Strategy.FSDP_SHARD_GRAD_OP)

    @property
    def shards_gradients(self) -> bool:
        return self.shards_parameters or self is Strategy.ZERO2

    @property
    def shards_optimizer_state(self) -> bool:
        return self.shards_gradients or self is Strategy.ZERO1


MULTI_DEVICE_STRATEGIES = tuple(s for s in Strategy if s is not Strategy.SINGLE)


@dataclass(frozen=True)
class ParallelPlan:
    """`num_devices` data-parallel ranks, each with the scenario's micro-batch."""

    num_devices: int = 1
    strategy: Strategy = Strategy.SINGLE
    # The lessons' LocalSGD(local_sgd_steps=K): parameters averaged every K calls of
    # local_sgd.step(), which the lessons' loop makes once per micro-batch.
    local_sgd_steps: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_devices, bool) or not isinstance(self.num_devices, int) \
                or not 1 <= self.num_devices <= MAX_DEVICES:
            raise PlannerInputError(f"number of devices must be an integer from 1 to {MAX_DEVICES}, "
                                    f"got {self.num_devices!r}")
        if not isinstance(self.strategy, Strategy):
            raise PlannerInputError(f"strategy must be a Strategy, got {self.strategy!r}")
        if self.num_devices == 1 and self.strategy is not Strategy.SINGLE:
            object.__setattr__(self, "strategy", Strategy.SINGLE)  # one rank: nothing to replicate or shard
        if self.num_devices > 1 and self.strategy is Strategy.SINGLE:
            raise PlannerInputError(f"{self.num_devices} devices need a strategy: "
                                    + ", ".join(s.value for s in MULTI_DEVICE_STRATEGIES))
        if self.local_sgd_steps is not None:
            if isinstance(self.local_sgd_steps, bool) or not isinstance(self.local_sgd_steps, int) \
                    or self.local_sgd_steps < 1:
                raise PlannerInputError(f"local SGD steps must be a positive integer, got {self.local_sgd_steps!r}")
            if self.strategy not in (Strategy.DDP, Strategy.SINGLE):
                # accelerate.local_sgd.LocalSGD accepts plain multi-device data parallel only.
                raise PlannerInputError(f"local SGD runs on DDP only (accelerate's LocalSGD), not {self.strategy.value}: "
                                        "use --strategy ddp")

    @property
    def distributed(self) -> bool:
        return self.num_devices > 1


def parse_strategy(value: str | Strategy) -> Strategy:
    if isinstance(value, Strategy):
        return value
    text = str(value).strip().lower().replace("_", "-")
    for member in Strategy:
        if member.value == text:
            return member
    raise PlannerInputError(f"unknown strategy {value!r}: choose one of "
                            + ", ".join(s.value for s in MULTI_DEVICE_STRATEGIES))
