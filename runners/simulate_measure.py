"""What the simulated measurement needs beyond fake tensors themselves.

Under torch's FakeTensorMode every tensor has a shape, dtype, device and storage size but
no data, so MemTracker's bookkeeping is exact and nothing is allocated: a 7B or 70B plan
can be checked on a laptop (../shared/DESIGN.md, "What measured means"). runners.measure
runs the real run's own model, batches and engine on fake tensors; what fake tensors
change about the path taken is undone by planner.probe.fake_mode (shared with the probe), so the simulated
peak equals the real CPU peak to the byte (tests/test_simulate.py).
"""

from __future__ import annotations

from torch._subclasses.fake_tensor import FakeTensorMode

from planner.probe.fake_mode import fake_batch, fake_quantile_maps  # shared with the probe


def fake_batches(real_batches: list[dict], fake_mode: FakeTensorMode) -> list[dict]:
    """Fake copies of real (small) batches, after checking the masks the patch relies on."""
    for batch in real_batches:
        if not bool((batch["attention_mask"] == 1).all()):
            raise ValueError("the simulator reproduces unpadded batches only (all-ones attention_mask)")
    return [fake_batch(fake_mode, batch) for batch in real_batches]


def simulate_step(config: dict, scenario_values: dict, gpu=None, steps: int = 2, seed: int = 0) -> dict:
    """The simulate mode's measured step (runners.measure.execute, Mode.SIMULATE: the lessons'
    loop under accelerate, MemTracker on fake tensors), in this process, with the kernels of
    `gpu` (planner.probe.fake_cuda: a CudaGpu or an architecture name such as "sm90") or,
    with None, the CPU's. The measured categories come back as execute's `measured`, plus
    `attention_backends`: the backend each attention call took (CUDA kernels only)."""
    from planner.probe.fake_mode import simulation
    from runners.measure import _optimizer_for, _train
    from runners.model_factory import build_model, synthetic_batch
    from runners.probes import MemTrackerProbe
    from runners.request import Mode, VerifyRequest

    request = VerifyRequest(config=config, model_name="simulated", scenario=scenario_values, mode=Mode.SIMULATE,
                            steps=steps, seed=seed)
    scenario = request.parsed_scenario()
    real_batches = [synthetic_batch(config, scenario, seed=i) for i in range(scenario.grad_accum_steps)]
    fake_mode = FakeTensorMode()
    with fake_mode:
        model = build_model(config, scenario, seed=seed)
    batches = fake_batches(real_batches, fake_mode)
    optimizer = _optimizer_for(request, scenario, model)
    fake_quantile_maps(optimizer, fake_mode)
    probe = MemTrackerProbe(cuda_kernels=gpu is not None)
    try:
        with simulation(fake_mode, gpu) as choices:
            _train(request, scenario, model, optimizer, batches, probe, cpu=True, on_step=lambda step, steps: None,
                   cuda_kernels=gpu is not None)
    finally:
        probe.close()
    if probe.result is None:
        raise RuntimeError("the measured step never ran")
    measured = probe.result.to_json()
    measured["attention_backends"] = [b.name.lower() for b in choices.attention] if choices is not None else []
    return measured
