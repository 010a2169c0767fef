"""One verification run, in the child process: build, train `steps` steps, measure the last.

`execute(request, progress)` is what runners.child calls; the mode is already concrete
(runners.verify resolves `auto`). CUDA out-of-memory propagates as torch.OutOfMemoryError
for the child to report as status "oom".
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable

import torch

from planner.scenario import Scenario
from runners.engines import run_accelerate_loop, run_trainer, trainer_builds_optimizer
from runners.model_factory import build_model, synthetic_batch
from runners.optimizers import build_optimizer
from runners.probes import CudaProbe, MemTrackerProbe
from runners.request import CUDA_ALLOC_CONF_ENV, Engine, Mode, VerifyRequest

ProgressSink = Callable[[dict], None]


def environment(mode: Mode) -> dict:
    import accelerate
    import transformers

    try:
        import bitsandbytes

        bnb_version = bitsandbytes.__version__
    except Exception:  # bitsandbytes is optional for runs that do not use 8-bit optimizers
        bnb_version = None
    device = torch.cuda.get_device_name() if mode is Mode.CUDA else platform.processor() or platform.machine()
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "accelerate": accelerate.__version__,
           "bitsandbytes": bnb_version, "python": platform.python_version(), "platform": platform.platform(),
           "device": device, "mode": mode.value, "cuda_alloc_conf": os.environ.get(CUDA_ALLOC_CONF_ENV)}
    if mode is Mode.CUDA:
        env.update(cuda_version=torch.version.cuda, compute_capability=list(torch.cuda.get_device_capability()))
    return env


def _emit(progress: ProgressSink, stage: str, message: str, step: int | None = None, steps: int | None = None) -> None:
    progress({"event": "progress", "stage": stage, "step": step, "steps": steps, "message": message})


def _optimizer_for(request: VerifyRequest, scenario: Scenario, model):
    """The optimizer to pass in, or None when TrainingArguments(optim=...) builds it.

    Simulated runs always pass one in: bitsandbytes' constructor must run outside fake
    mode (DESIGN, Known facts), and runners.optimizers builds the same state.
    """
    if request.engine is Engine.TRAINER and trainer_builds_optimizer(scenario) and request.mode is not Mode.SIMULATE:
        return None
    return build_optimizer(model, scenario.optimizer)


def _train(request: VerifyRequest, scenario: Scenario, model, optimizer, batches, probe, cpu: bool,
           on_step: Callable[[int, int], None], cuda_kernels: bool = False) -> None:
    """`cuda_kernels`: a simulated step on CUDA's kernels (runners.simulate_measure.simulate_step)."""
    if request.engine is Engine.TRAINER:  # real runs only: simulate mode refuses it (runners.request)
        run_trainer(model, optimizer, batches, scenario, request.steps, probe, cpu=cpu, progress=on_step)
    else:
        run_accelerate_loop(model, optimizer, batches, scenario, request.steps, probe, cpu=cpu,
                            local_sgd_steps=request.local_sgd_steps, progress=on_step, cuda_kernels=cuda_kernels)


def execute(request: VerifyRequest, progress: ProgressSink) -> dict:
    if request.mode is Mode.AUTO:
        raise ValueError("execute() needs a concrete mode: runners.verify resolves auto")
    scenario = request.parsed_scenario()
    started = time.perf_counter()
    cuda = request.mode is Mode.CUDA
    extras: dict = {}

    def on_step(step: int, steps: int) -> None:
        if cuda and step == 2:
            extras["after_first_step_bytes"] = torch.cuda.memory_allocated()
        _emit(progress, "step", f"step {step} of {steps}" + (" (measured)" if step == steps else ""), step, steps)

    _emit(progress, "building model", f"building {request.model_name} from its config (random weights)")
    real_batches = [synthetic_batch(request.config, scenario, seed=i) for i in range(scenario.grad_accum_steps)]
    if request.mode is Mode.SIMULATE:
        from torch._subclasses.fake_tensor import FakeTensorMode

        from planner.probe.fake_mode import simulation
        from runners.simulate_measure import fake_batches, fake_quantile_maps

        fake_mode = FakeTensorMode()
        with fake_mode:
            model = build_model(request.config, scenario, seed=request.seed)
        batches = fake_batches(real_batches, fake_mode)
        optimizer = _optimizer_for(request, scenario, model)
        fake_quantile_maps(optimizer, fake_mode)
        probe = MemTrackerProbe()
        with simulation(fake_mode):
            _train(request, scenario, model, optimizer, batches, probe, cpu=True, on_step=on_step)
    else:
        if cuda:
            torch.cuda.init()
            free, total = torch.cuda.mem_get_info()
            # What other processes and this one's CUDA context hold before any tensor.
            extras["cuda_context_bytes"] = total - free - torch.cuda.memory_reserved()
            extras["cuda_total_bytes"] = total
        device = "cuda" if cuda else "cpu"
        model = build_model(request.config, scenario, seed=request.seed).to(device)
        batches = [{k: v.to(device) for k, v in batch.items()} for batch in real_batches]
        if cuda:
            extras["after_load_bytes"] = torch.cuda.memory_allocated()
        probe = CudaProbe() if cuda else MemTrackerProbe()
        _train(request, scenario, model, _optimizer_for(request, scenario, model), batches, probe, cpu=not cuda,
               on_step=on_step)
        if cuda:
            extras["reserved_bytes"] = torch.cuda.memory_reserved()
            free, total = torch.cuda.mem_get_info()
            # The context after the run: lazy loading has brought in the step's kernels and
            # cuBLAS its handles (planner.cuda_overheads, Known limitations).
            extras["cuda_context_after_run_bytes"] = total - free - torch.cuda.memory_reserved()
    _emit(progress, "measuring", "collecting the measured step")
    if probe.result is None:
        raise RuntimeError("the measured step never ran: the engine stopped before the last step")
    measured = probe.result.to_json()
    measured.update(extras)
    measured["run_wall_s"] = time.perf_counter() - started
    return {"status": "ok", "mode": request.mode.value, "engine": request.engine.value, "measured": measured,
            "environment": environment(request.mode), "reason": None, "oom_requested_bytes": None}


def measure_in_process(config: dict, model_name: str, scenario_values: dict, mode: Mode,
                       engine: Engine = Engine.ACCELERATE, steps: int = 2) -> dict:
    """`execute` in this process, without progress: for tests and benchmarks that run many
    small scenarios (runners.verify runs each in a child process instead)."""
    request = VerifyRequest(config=config, model_name=model_name, scenario=scenario_values, mode=mode,
                            engine=engine, steps=steps)
    return execute(request, lambda event: None)
