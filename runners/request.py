"""What a verification run is asked to do, and what it answers: plain JSON-able data,
because it crosses a process boundary (the run executes in a child process).

A `VerifyRequest` names a scenario (the planner's values), the model config, the
measurement mode and the training engine. The child answers with progress events and
one result (runners.measure.execute builds it).
"""

from __future__ import annotations

import enum
import sys
from dataclasses import asdict, dataclass, field

from planner.errors import PlannerInputError
from planner.scenario import Device, Engine, Scenario, capability_text, parse_enum, scenario_from_values
from planner.strategy import Strategy

# The strategies a verification run can launch (runners.rank_worker): the ZeRO stages are
# planned, not run. Here, beside the request, so pages read it without importing torch.
VERIFIED_STRATEGIES = (Strategy.DDP, Strategy.FSDP_FULL_SHARD, Strategy.FSDP_SHARD_GRAD_OP)


class Mode(enum.Enum):
    AUTO = "auto"  # cuda when available, else cpu when it fits in free RAM, else simulate
    CUDA = "cuda"  # torch.cuda.max_memory_allocated over the steady-state step
    CPU = "cpu"  # torch MemTracker over real tensors
    SIMULATE = "simulate"  # torch MemTracker under FakeTensorMode: nothing allocated


# Trainer reads loss values and token counts with .item() (logging, num_items_in_batch):
# data that fake tensors do not have. The Accelerate loop reads none.
SIMULATE_NEEDS_ACCELERATE = ("simulate mode runs the Accelerate loop only (the Trainer reads loss values, which "
                             "fake tensors do not have): use --engine accelerate, or --mode cpu/cuda for the Trainer")

# Faults a test can ask the child to stage, so every failure path runs for real.
MAX_SEED = 2**32 - 1  # numpy's seed range, the narrowest of the generators a run seeds
INJECTABLE_FAULTS = ("hang", "sigkill-self", "import-error", "raise", "cuda-oom", "hog-memory")
# The child's PYTORCH_CUDA_ALLOC_CONF (e.g. "expandable_segments:True"): torch reads it once,
# when CUDA initialises, so it is set in the child's environment before torch is imported.
CUDA_ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
MAX_ALLOC_CONF_CHARS = 200


def scenario_measured_on(scenario: dict, device: Device) -> dict:
    """Scenario values as a run on `device` measures them: on the CPU's kernels, or on this
    machine's GPU's whatever GPU the plan named (its compute capability picks SDPA's kernels,
    planner.probe.cache.kernel_class)."""
    measured = {k: v for k, v in scenario.items() if k != "compute_capability"} | {"device": device.value}
    torch = sys.modules.get("torch")  # a run on CUDA has loaded it; a plan for another machine has not
    if device is Device.CUDA and torch is not None and torch.cuda.is_available():
        measured["compute_capability"] = capability_text(torch.cuda.get_device_capability())
    return measured


@dataclass(frozen=True)
class VerifyRequest:
    config: dict  # the model's config.json content
    model_name: str
    scenario: dict  # planner scenario values: task, batch_size, seq_len, optimizer, ... (underscore names)
    mode: Mode = Mode.AUTO
    engine: Engine = Engine.ACCELERATE
    steps: int = 3  # optimizer steps; step 1 builds optimizer state, the last one is measured
    local_sgd_steps: int | None = None
    seed: int = 0
    inject_fault: str | None = None  # tests only: one of INJECTABLE_FAULTS
    extra: dict = field(default_factory=dict)
    # The child's PYTORCH_CUDA_ALLOC_CONF; None: the parent's environment is inherited as it is.
    cuda_alloc_conf: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or not 2 <= self.steps <= 1000:
            raise PlannerInputError(f"steps must be an integer from 2 to 1000 (step 1 creates the optimizer state), got {self.steps!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise PlannerInputError(f"seed must be an integer from 0 to {MAX_SEED:,}, got {self.seed!r}")
        if self.local_sgd_steps is not None and (not isinstance(self.local_sgd_steps, int) or self.local_sgd_steps < 1):
            raise PlannerInputError(f"local SGD steps must be a positive integer, got {self.local_sgd_steps!r}")
        if self.inject_fault is not None and self.inject_fault not in INJECTABLE_FAULTS:
            raise PlannerInputError(f"unknown fault {self.inject_fault!r}: one of {', '.join(INJECTABLE_FAULTS)}")
        if self.cuda_alloc_conf is not None and (
                not isinstance(self.cuda_alloc_conf, str) or len(self.cuda_alloc_conf) > MAX_ALLOC_CONF_CHARS
                or not self.cuda_alloc_conf.isprintable()):
            raise PlannerInputError(f"cuda_alloc_conf must be one line of at most {MAX_ALLOC_CONF_CHARS} characters "
                                    f"(e.g. 'expandable_segments:True'), got {str(self.cuda_alloc_conf)[:40]!r}")
        if self.mode is Mode.SIMULATE and self.engine is Engine.TRAINER:
            raise PlannerInputError(SIMULATE_NEEDS_ACCELERATE)
        self.parsed_scenario()  # validates the scenario values now, in the caller's process

    def parsed_scenario(self) -> Scenario:
        """The scenario this run trains: its engine is the request's."""
        return scenario_from_values(**{**self.scenario, "engine": self.engine.value})

    def to_json(self) -> dict:
        data = asdict(self)
        data["mode"] = self.mode.value
        data["engine"] = self.engine.value
        return data

    @classmethod
    def from_json(cls, data: dict) -> "VerifyRequest":
        values = dict(data)
        values["mode"] = parse_enum(Mode, values.get("mode", "auto"), "measurement mode")
        values["engine"] = parse_enum(Engine, values.get("engine", "accelerate"), "engine")
        return cls(**values)
