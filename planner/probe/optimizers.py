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


def build_optimizer(model: torch.nn.Module, optimizer: Optimizer, lr: float = LEARNING_RATE):
    params = [p for p in model.parameters() if p.requires_grad]
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
    groups = decay_parameter_groups(model)
    if optimizer is Optimizer.ADAM8BIT:
        return bnb.optim.Adam8bit(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    if optimizer is Optimizer.ADAMW8BIT:
        return bnb.optim.AdamW8bit(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    if optimizer is Optimizer.PAGED_ADAMW8BIT:
        return bnb.optim.PagedAdamW8bit(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    raise ValueError(f"no builder for optimizer {optimizer}")
