"""Real optimizers for the planner's optimizer names, built the way the lessons build them
(verification runs and the probe of the optimizer step both use these).

- 8-bit Adam/AdamW (bitsandbytes): two parameter groups as in the lesson, weight decay
  on every parameter except LayerNorm weights and biases (transformers'
  `get_parameter_names(model, [nn.LayerNorm])` minus names containing "bias").
- hf-adafactor: transformers' Adafactor with the keyword arguments TrainingArguments(optim="adafactor")
  passes (`scale_parameter=False, relative_step=False`; Trainer.get_optimizer_cls_and_kwargs).
"""

from __future__ import annotations

import torch

from planner.scenario import Optimizer

LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.01

# TrainingArguments(optim=...) strings whose optimizer is the planner's: with the Trainer
# these are built by Trainer.create_optimizer (its parameter groups); the others are
# passed to the Trainer ready-built, as the lesson does for 8-bit Adam.
TRAINER_OPTIM = {Optimizer.ADAMW: "adamw_torch", Optimizer.ADAMW_FUSED: "adamw_torch_fused",
                 Optimizer.HF_ADAFACTOR: "adafactor", Optimizer.ADAMW8BIT: "adamw_bnb_8bit",
                 Optimizer.PAGED_ADAMW8BIT: "paged_adamw_8bit"}


def trainer_parameter_groups(model: torch.nn.Module) -> list[dict]:
    """Trainer.create_optimizer's two groups, in its order: parameters that decay (not
    norms, not biases: Trainer.get_decay_parameter_names), then the rest. The order
    matters to memory: a single-tensor loop keeps the previous tensor's temporary alive
    while it computes the next one's."""
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n in decay], "weight_decay": 0.0},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


def decay_parameter_groups(model: torch.nn.Module, weight_decay: float = WEIGHT_DECAY) -> list[dict]:
    from transformers.trainer_pt_utils import get_parameter_names

    decay = {n for n in get_parameter_names(model, [torch.nn.LayerNorm]) if "bias" not in n}
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


def reset_bitsandbytes_overrides() -> None:
    """bitsandbytes keeps per-parameter overrides (Trainer's 32-bit embeddings) in a
    process-wide GlobalOptimManager keyed by id(); a later run in the same process could
    inherit them through reused ids, so every build starts from an empty registry."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return
    bnb.optim.GlobalOptimManager.get_instance().initialize()


def build_optimizer(model: torch.nn.Module, optimizer: Optimizer, lr: float = LEARNING_RATE,
                    groups: list[dict] | None = None):
    """`groups`, when given, replace the default parameter list (and 8-bit Adam's groups)."""
    params = groups if groups is not None else [p for p in model.parameters() if p.requires_grad]
    if optimizer is Optimizer.ADAMW:
        return torch.optim.AdamW(params, lr=lr)
    if optimizer is Optimizer.ADAMW_FUSED:
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if optimizer is Optimizer.ADAM:
        return torch.optim.Adam(params, lr=lr)
    if optimizer is Optimizer.SGD:
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if optimizer is Optimizer.ADAFACTOR:
        return torch.optim.Adafactor(params, lr=lr)
    if optimizer is Optimizer.HF_ADAFACTOR:
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False)
    import bitsandbytes as bnb

    reset_bitsandbytes_overrides()
    groups = groups if groups is not None else decay_parameter_groups(model)
    if optimizer is Optimizer.ADAM8BIT:
        return bnb.optim.Adam8bit(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    if optimizer is Optimizer.ADAMW8BIT:
        return bnb.optim.AdamW8bit(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    if optimizer is Optimizer.PAGED_ADAMW8BIT:
        return bnb.optim.PagedAdamW8bit(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    raise ValueError(f"no builder for optimizer {optimizer}")
