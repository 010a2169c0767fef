"""The optimizer step's temporaries, probed: the real optimizer's steady-state step on the
reduced model's fake parameters and gradients.

On CPU every optimizer of the product updates one parameter tensor at a time (torch's
single-tensor loops, transformers' Adafactor, bitsandbytes' blockwise kernels), so what the
step allocates and frees at its high point belongs to one tensor, and the reduced model
holds every distinct parameter shape of the real one (same widths; embeddings, head and one
block of each kind). The loop keeps the previous tensor's temporary alive while it works on
the next, so the order of the tensors matters: the Trainer's own optimizers take its two
parameter groups (decaying weights first, norms and biases after), as its
create_optimizer builds them. The Trainer clips gradients first (`max_grad_norm=1.0`): one
0-d norm per parameter tensor, alive together; that term is counted for the probed
tensors only.

Known limitations: the CUDA default (foreach) updates all tensors at once; its temporaries
are planner.optimizer_step's, read from the code. With `gpu` the probe takes the foreach
path, but on the reduced model's tensors only, which is not the real model's total.
"""

from __future__ import annotations

import dataclasses
import json
import warnings

from planner.finetune import Method
from planner.model_shape import ModelShape
from planner.scenario import Engine, Optimizer, Precision, Scenario


def step_temporaries(shape: ModelShape, scenario: Scenario, gpu=None) -> int:
    """Peak live bytes above the start of a steady-state optimizer step (bytes). `gpu`: take
    that GPU's CUDA defaults (planner.probe.fake_cuda: foreach for torch's optimizers); None,
    the CPU's."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from planner.probe.build import build_model
    from planner.probe.fake_mode import fake_quantile_maps, simulation
    from planner.probe.memtracker import TrainableMemTracker
    from planner.probe.optimizers import (
        TRAINER_OPTIM,
        build_optimizer,
        trainer_parameter_groups,
    )
    from planner.probe.run import BlocksNotFound, layout_for, reduced_config
    from planner.shapes_from_config import load_transformers_config

    config_dict = json.loads(shape.source_config)
    config = load_transformers_config(config_dict, scenario.task, scenario.num_labels)
    try:
        reduced = reduced_config(config, layout_for(config, scenario.task), window_exceeded=False)
    except BlocksNotFound:  # a depth the config cannot set: every block
        reduced = config
    built = scenario
    if scenario.finetune.method is Method.QLORA:
        # The step touches the trainable tensors only, and QLoRA's are LoRA's on an fp32 base
        # (prepare_model_for_kbit_training casts every float parameter to fp32), in the same
        # order; a 4-bit base cannot be quantised from fake weights.
        built = dataclasses.replace(scenario, precision=Precision.FP32,
                                    finetune=dataclasses.replace(scenario.finetune, method=Method.LORA))
    fake = FakeTensorMode()
    with fake, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model(config_dict, built, config=reduced)
        for parameter in model.parameters():
            if parameter.requires_grad:  # LoRA: the adapters only; the frozen base has no gradient
                parameter.grad = torch.zeros_like(parameter)
    trainer_built = scenario.engine is Engine.TRAINER and scenario.optimizer in TRAINER_OPTIM
    groups = trainer_parameter_groups(model) if trainer_built else None
    # bitsandbytes' constructor runs outside fake mode.
    optimizer = build_optimizer(model, scenario.optimizer, groups=groups)
    if scenario.engine is Engine.TRAINER and scenario.optimizer in (Optimizer.ADAMW8BIT, Optimizer.PAGED_ADAMW8BIT):
        # Trainer.create_optimizer keeps embeddings in 32-bit state.
        import bitsandbytes as bnb

        manager = bnb.optim.GlobalOptimManager.get_instance()
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                manager.register_module_override(module, "weight", {"optim_bits": 32})
    fake_quantile_maps(optimizer, fake)
    with simulation(fake, gpu), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer.step()  # the first step creates the state
        tracker = TrainableMemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            start = max(snap["Total"] for snap in tracker.get_tracker_snapshot("current").values())
            if scenario.engine is Engine.TRAINER:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            peak = max(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    return peak - start
