"""The fine-tuning method of a scenario: full, LoRA or QLoRA, with PEFT's and
transformers' own meanings.

LoRA's fields are `peft.LoraConfig`'s (r, lora_alpha, lora_dropout, target_modules;
`all-linear` is PEFT's shorthand for every linear layer but the output layer); QLoRA's
are `transformers.BitsAndBytesConfig`'s (`bnb_4bit_quant_type`,
`bnb_4bit_use_double_quant`), the compute dtype following the scenario's precision.
Defaults are what the QLoRA paper and PEFT's examples use: r 16, alpha 2r, dropout 0.05,
nf4 with double quantisation. Torch-free: the planner's fast path reads it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from planner.errors import PlannerInputError

ALL_LINEAR = "all-linear"
QUANT_TYPES = ("nf4", "fp4")
# `planner batch` keys (and the dashboard's URL keys) of the method.
FINETUNE_KEYS = ("finetune", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "quant_type", "double_quant")


class Method(enum.Enum):
    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"


@dataclass(frozen=True)
class FineTune:
    method: Method = Method.FULL
    lora_r: int = 16
    lora_alpha: float | None = None  # None: 2 x r
    lora_dropout: float = 0.05
    lora_targets: tuple[str, ...] | str = ALL_LINEAR  # module names, or ALL_LINEAR
    quant_type: str = "nf4"
    double_quant: bool = True

    @property
    def alpha(self) -> float:
        return 2 * self.lora_r if self.lora_alpha is None else self.lora_alpha

    @property
    def targets_text(self) -> str:
        """The targets as a user writes them: `all-linear` or `q_proj,v_proj`."""
        return self.lora_targets if isinstance(self.lora_targets, str) else ",".join(self.lora_targets)

    @property
    def uses_adapters(self) -> bool:
        return self.method is not Method.FULL


def parse_targets(text: str) -> tuple[str, ...] | str:
    """`all-linear` or comma-separated module names (`q_proj,v_proj`), as LoraConfig takes them."""
    text = str(text).strip()
    if text == ALL_LINEAR:
        return ALL_LINEAR
    names = tuple(name.strip() for name in text.split(","))
    if not text or any(not name or not name.replace("_", "").replace(".", "").isalnum() for name in names):
        raise PlannerInputError(f"LoRA targets {text[:80]!r} are not module names: write `all-linear` or "
                                "names such as `q_proj,v_proj`")
    return names


def finetune_from_values(method: str = "full", lora_r: int = 16, lora_alpha: float | None = None,
                         lora_dropout: float = 0.05, lora_targets: str | tuple = ALL_LINEAR,
                         quant_type: str = "nf4", double_quant: bool = True) -> FineTune:
    """A checked FineTune; every bad value is one line saying what to write instead."""
    try:
        chosen = Method(str(method))
    except ValueError:
        raise PlannerInputError(f"fine-tuning method {str(method)[:40]!r} is not one of full, lora, qlora") from None
    if isinstance(lora_r, bool) or not isinstance(lora_r, int) or lora_r < 1:
        raise PlannerInputError(f"LoRA rank {lora_r!r} must be a whole number of at least 1")
    if lora_alpha is not None and (isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float))
                                   or not math.isfinite(lora_alpha) or lora_alpha <= 0):
        raise PlannerInputError(f"LoRA alpha {lora_alpha!r} must be a positive number")
    if (isinstance(lora_dropout, bool) or not isinstance(lora_dropout, (int, float))
            or not 0 <= lora_dropout < 1):
        raise PlannerInputError(f"LoRA dropout {lora_dropout!r} must be a probability in [0, 1)")
    if quant_type not in QUANT_TYPES:
        raise PlannerInputError(f"quantisation type {str(quant_type)[:40]!r} is not one of nf4, fp4")
    targets = lora_targets if isinstance(lora_targets, tuple) else parse_targets(lora_targets)
    return FineTune(chosen, lora_r, lora_alpha, float(lora_dropout), targets, quant_type, bool(double_quant))
