"""QLoRA's 4-bit base on fake tensors, as transformers' bitsandbytes load leaves it, and
bitsandbytes' 4-bit matmul as it runs on a GPU.

A real QLoRA model is quantised from real weights as `from_pretrained` loads them
(planner.probe.build.quantized_lora). Fake tensors cannot take that path: bitsandbytes'
`Params4bit` is a tensor subclass made with `torch.Tensor._make_subclass`, which refuses a
tensor already bound to a FakeTensor, and `from_pretrained` reads files. So
`fake_quantized_model` takes the same steps with the libraries' own code, on fake tensors:

1. transformers' quantizer (`AutoHfQuantizer.from_config(BitsAndBytesConfig(...))`)
   `preprocess_model`: it picks the modules left unconverted (`get_modules_to_not_convert`:
   the output layer, tied weights, `_keep_in_fp32_modules`) and converts the rest with
   `replace_with_bnb_linear`, on the meta device as `from_pretrained` does before loading.
2. Each converted layer's weight is "loaded" as `Params4bit._quantize` quantises it on
   `.to(device)`: a weight of the model's dtype goes through `bitsandbytes.functional.
   quantize_4bit` with the Params4bit's own block size, double quantisation, type and
   storage dtype (the ops' fake kernels give the packed weight, absmax and nested state
   their real shapes and dtypes). The packed weight becomes a frozen fake Parameter that
   carries the Params4bit's attributes (`quant_state`, `quant_type`, `blocksize`, ...), which
   is all that `Linear4bit.forward`, `matmul_4bit` and PEFT's 4-bit LoRA layer read. A bias
   is a fake Parameter of the model's dtype, as the load leaves it.
3. The quantizer's `postprocess_model` (`is_loaded_in_4bit`), and `model.hf_quantizer`, as
   `from_pretrained` sets it.

tests/test_qlora.py checks the result against a real load parameter by parameter
(names, shapes, dtypes, quantisation state), and the probe of both against each other.

`gemm_4bit_as_on_cuda()`: `MatMul4Bit.forward` calls `torch.ops.bitsandbytes.gemm_4bit`,
whose fake kernel returns only the output. On CUDA, bitsandbytes 0.50's kernel
(backends/cuda/ops.py) runs its fused kernel only when `_gemm_4bit_use_custom_cuda` says
so, which for a micro-batch of more than 1536 tokens (M) it never does on any
architecture (the small-weight cap is M <= 1536, every other cap M <= 512): it calls
`_gemm_4bit_default_impl`, which dequantises the absmax under double quantisation
(`dequantize_blockwise` plus the offset: fp32 temporaries of one value per 64 weights, the
sum's operand freed once it is made), dequantises the weight (a temporary of the full
weight in the compute dtype) and runs `F.linear`. Inside the context, that implementation runs in place of the op's fake kernel
when its inputs are fake, one op at a time, so a memory tracker sees each temporary. At
1536 tokens or fewer the fused kernel may be taken for some layer shapes and allocate no
dequantised weight: the probe then counts up to one weight's dequantised copy more than
such a step holds (README, QLoRA).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

# What Params4bit keeps besides its data (bitsandbytes 0.50 nn/modules.py, Params4bit.__new__).
_PARAMS4BIT_FIELDS = ("blocksize", "compress_statistics", "quant_type", "quant_storage", "module")


def fake_quantized_model(model: torch.nn.Module, settings) -> torch.nn.Module:
    """`model` (fake tensors, built in the dtype it is loaded in) with its linear layers
    converted and quantised as `from_pretrained(..., quantization_config=settings)` would
    leave them (module doc). Call with `model`'s fake mode active."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_functional
    from transformers.quantizers import AutoHfQuantizer

    dtype = next(model.parameters()).dtype
    quantizer = AutoHfQuantizer.from_config(settings, pre_quantized=False)
    with unset_fake_temporarily(), torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantizer.preprocess_model(model, dtype=dtype, device_map="cpu")
    # quantize_blockwise builds its 256-entry map with `.tolist()` on first use: build it real,
    # then give the fake ops a fake copy (restored after).
    maps = bnb_functional.name2qmap
    had_dynamic = "dynamic" in maps
    previous = maps.get("dynamic")
    with unset_fake_temporarily():
        real_map = bnb_functional.create_dynamic_map()
    fake_mode = next(p for p in model.parameters() if isinstance(p, FakeTensor)).fake_mode
    maps["dynamic"] = fake_mode.from_tensor(real_map)
    try:
        for module in model.modules():
            if isinstance(module, bnb.nn.Linear4bit):
                _load_quantized(module, dtype, bnb_functional)
    finally:
        if had_dynamic:
            maps["dynamic"] = previous
        else:
            del maps["dynamic"]
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer
    return model


def _load_quantized(module: torch.nn.Module, dtype: torch.dtype, bnb_functional) -> None:
    """Params4bit._quantize on a fake weight of `dtype`: the packed data and its quant state."""
    fields = {name: getattr(module.weight, name) for name in _PARAMS4BIT_FIELDS}
    weight = torch.empty(module.out_features, module.in_features, dtype=dtype)
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=fields["blocksize"],
                                                 compress_statistics=fields["compress_statistics"],
                                                 quant_type=fields["quant_type"],
                                                 quant_storage=fields["quant_storage"])
    del weight
    parameter = torch.nn.Parameter(packed, requires_grad=False)
    for name, value in fields.items():
        setattr(parameter, name, value)
    parameter.quant_state = state
    parameter.bnb_quantized = True
    module.weight = parameter
    module.quant_state = state  # Params4bit._quantize sets it on its module too
    if module.bias is not None:
        module.bias = torch.nn.Parameter(torch.empty(module.out_features, dtype=dtype), requires_grad=False)


@contextlib.contextmanager
def gemm_4bit_as_on_cuda():
    """Inside: a fake `bitsandbytes::gemm_4bit` runs bitsandbytes' own dequantise-then-linear
    implementation, as its CUDA kernel does for micro-batches of more than 1536 tokens (module doc)."""
    import bitsandbytes  # noqa: F401 - registers torch.ops.bitsandbytes
    from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl

    packet = torch.ops.bitsandbytes.gemm_4bit
    fused = packet.default

    def gemm_4bit(A, B, *args, **kwargs):
        if isinstance(A, FakeTensor):
            return _gemm_4bit_default_impl(A, B, *args, **kwargs)
        return fused(A, B, *args, **kwargs)

    packet.default = gemm_4bit
    try:
        yield
    finally:
        packet.default = fused
