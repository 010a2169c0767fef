"""The two training paths of the lessons, instrumented for one measured step.

- `run_accelerate_loop`: the lessons' Accelerator loop, written as they write it:
  `outputs = model(...)`, `loss = outputs.loss`, `accelerator.backward(loss)`,
  `optimizer.step()`, `optimizer.zero_grad()` inside `accelerator.accumulate(model)`,
  and `local_sgd.step()` inside `LocalSGD(...)` when local SGD is on. `outputs` is a
  plain variable, so the previous micro-batch's outputs (logits included) stay alive
  until the next forward returns: the planner models that (Engine.ACCELERATE).
- `run_trainer`: transformers' Trainer with TrainingArguments(optim=..., bf16=...,
  gradient_checkpointing=..., gradient_accumulation_steps=...). Trainer.compute_loss
  returns the loss only, so outputs die before backward (Engine.TRAINER).

The last of `steps` optimizer steps is measured (step 1 creates the optimizer state).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable

import torch

from planner.estimate import Phase
from planner.probe.build import fresh_accelerator  # noqa: F401  (shared with the probe; rank_worker imports it here)
from planner.probe.optimizers import TRAINER_OPTIM as _TRAINER_OPTIM  # the Trainer's own optimizers, shared with the probe
from planner.scenario import Checkpointing, Precision, Scenario

Progress = Callable[[int, int], None]  # (step index from 1, steps)

def run_accelerate_loop(model, optimizer, batches: list[dict], scenario: Scenario, steps: int, probe,
                        cpu: bool, local_sgd_steps: int | None = None, progress: Progress | None = None,
                        accelerator=None, on_prepared: Callable | None = None, cuda_kernels: bool = False) -> None:
    """`steps` optimizer steps over the same micro-batches; the last one watched by `probe`.
    `cuda_kernels`: a simulated step on CUDA's kernels, which autocasts as on a GPU
    (planner.probe.build.autocast_as_on_cuda).

    A distributed run passes its own `accelerator` (one per process, built by
    runners.rank_worker) and `on_prepared(model, optimizer)` to see the wrapped model
    (DDP or FSDP) before the first step.
    """
    from accelerate.local_sgd import LocalSGD

    if accelerator is None:
        accelerator = fresh_accelerator(scenario, cpu, cuda_kernels=cuda_kernels)
    model, optimizer = accelerator.prepare(model, optimizer)
    if on_prepared is not None:
        on_prepared(model, optimizer)
    unwrapped = accelerator.unwrap_model(model)
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=local_sgd_steps or 1,
                  enabled=local_sgd_steps is not None) as local_sgd:
        for step in range(steps):
            if progress is not None:
                progress(step + 1, steps)
            if step == steps - 2:
                probe.track(unwrapped, optimizer.optimizer)
            watched = probe if step == steps - 1 else None
            if watched:
                watched.begin()
            for batch in batches:
                if step >= steps - 2:
                    probe.micro_batch()
                with accelerator.accumulate(model):
                    outputs = model(**batch)
                    loss = outputs.loss
                    if watched:
                        watched.mark(Phase.FORWARD)
                    accelerator.backward(loss)
                    if watched:
                        watched.mark(Phase.BACKWARD)
                    optimizer.step()  # a no-op until the last micro-batch of the cycle
                    optimizer.zero_grad()
                    if local_sgd_steps is not None:
                        local_sgd.step()
            if watched:
                watched.mark(Phase.OPTIMIZER_STEP)
                watched.end()


class _ListDataset(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


def _rows(batches: list[dict], steps: int) -> list[dict]:
    """Per-example rows that the Trainer re-batches into the same micro-batches, `steps` times."""
    one_cycle = [{k: v[i] for k, v in batch.items()} for batch in batches for i in range(len(batch["input_ids"]))]
    return one_cycle * steps


def run_trainer(model, optimizer, batches: list[dict], scenario: Scenario, steps: int, probe, cpu: bool,
                progress: Progress | None = None) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class _Watch(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            if progress is not None:
                progress(state.global_step + 1, steps)
            if state.global_step == steps - 2:
                trainer.tracking = True
                probe.track(model, getattr(optimizer, "optimizer", optimizer))
            if state.global_step == steps - 1:
                trainer.watched = probe
                probe.begin()

        def on_step_end(self, args, state, control, **kwargs):
            if trainer.watched is not None:
                trainer.watched.mark(Phase.OPTIMIZER_STEP)
                trainer.watched.end()
                trainer.watched = None

    class _MeasuredTrainer(Trainer):
        watched = None
        tracking = False

        def _move_model_to_device(self, model, device):
            pass  # the caller placed the model already (see fresh_accelerator)

        def compute_loss(self, model, inputs, *args, **kwargs):
            if self.tracking:
                probe.micro_batch()
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            if self.watched is not None:
                self.watched.mark(Phase.FORWARD)
            return loss

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            if self.watched is not None:
                self.watched.mark(Phase.BACKWARD)
            return loss

    from runners.optimizers import reset_bitsandbytes_overrides

    reset_bitsandbytes_overrides()
    # The Trainer insists on an output_dir (save_strategy "no" writes nothing to it): a
    # temporary one, removed with the run (in a child it also sits in the run's scratch TMPDIR).
    with tempfile.TemporaryDirectory(prefix="planner-trainer-") as output_dir:
        arguments = dict(
            output_dir=output_dir, max_steps=steps, per_device_train_batch_size=scenario.batch_size,
            gradient_accumulation_steps=scenario.grad_accum_steps, learning_rate=1e-4, lr_scheduler_type="constant",
            bf16=scenario.precision is Precision.BF16_MIXED, fp16=scenario.precision is Precision.FP16_MIXED,
            gradient_checkpointing=scenario.checkpointing is Checkpointing.EVERY_LAYER,
            report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, use_cpu=cpu,
            dataloader_num_workers=0, dataloader_pin_memory=False, remove_unused_columns=False, seed=0,
        )
        if optimizer is None:
            arguments["optim"] = _TRAINER_OPTIM[scenario.optimizer]
        trainer = _MeasuredTrainer(model=model, args=TrainingArguments(**arguments),
                                   train_dataset=_ListDataset(_rows(batches, steps)),
                                   optimizers=(optimizer, None) if optimizer is not None else (None, None),
                                   callbacks=[_Watch()])
        trainer.train()


def trainer_builds_optimizer(scenario: Scenario) -> bool:
    """True when TrainingArguments(optim=...) names the planner's optimizer exactly."""
    return scenario.optimizer in _TRAINER_OPTIM
