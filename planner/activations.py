"""Activation memory: the tensors autograd saves for backward, per block, per family.

A first, honest model (issue "Planner core"); the accuracy work comes later. Each term
is one saved tensor (or a group of tensors of the same shape) and says what saves it.
Sizes use the notation of Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models" (arXiv:2205.05198, section 4.1), where one layer saves
s*b*h*(34 + 5*a*s/h) bytes in 16-bit with 1-byte dropout masks; we keep their
decomposition but count what the Hugging Face implementations actually save:
  H  = b*s*h        hidden states             I  = b*s*i      MLP intermediate
  Q  = b*s*a*d      queries (a heads)         KV = b*s*g*d    keys or values (g KV heads)
  S2 = b*a*s*s      attention scores          LSE = b*a*s     SDPA's log-sum-exp (fp32)
  T  = b*s          one scalar per token (LayerNorm mean/rstd, RMSNorm rsqrt)

Element sizes by precision: linear inputs/outputs, attention and activation functions run
in the compute dtype (2 bytes under autocast or pure bf16, else 4); the residual stream
and LayerNorm inputs stay fp32 under autocast (torch autocast runs layer_norm in fp32 and
promotes the residual add). Dropout masks: on CUDA one byte per element
(native_dropout's bool mask); on CPU torch's dropout multiplies by a noise tensor as
large as its input, in the input's dtype (ATen Dropout.cpp `_dropout_impl`).

Known limitations (to be measured and fixed by the accuracy issue): autocast copies of
rotary tensors, SDPA math-path scaled copies of q and k, NewGELU's exact intermediates,
allocator rounding, and activation-function variants beyond gelu/gelu_new/relu/silu are
approximated as described at each term.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.model_shape import ArchFamily, ModelShape
from planner.scenario import Attention, Device, Precision, Scenario, Task

FP32 = 4


@dataclass(frozen=True)
class ActivationTerm:
    name: str
    num_bytes: int
    source: str


@dataclass(frozen=True)
class ActivationProfile:
    """Saved-for-backward bytes of one micro-batch, split where checkpointing splits them."""

    embedding: tuple[ActivationTerm, ...]
    per_layer: tuple[ActivationTerm, ...]  # one block; multiply by num_layers
    head: tuple[ActivationTerm, ...]  # final norm, logits, loss
    checkpoint_input_bytes: int  # kept per block under gradient checkpointing (its input)
    checkpoint_mask_bytes: int  # a materialised 4-D attention mask, kept as every checkpointed block's input
    output_logits_bytes: int  # the logits the model returns; how long they live is the engine's doing
    loss_forward_transient_bytes: int  # fp32 logits copy alive while the loss runs
    loss_backward_transient_bytes: int  # gradients of the loss w.r.t. logits
    layer_backward_transient_bytes: int  # largest gradients alive inside one block's backward
    block_backward_start_transient_bytes: int  # inside the last block's MLP backward
    block_entry_transient_bytes: int  # gradients arriving at a block, before it frees anything
    block_tail_bytes: int  # saved by a block's last ops, freed before backward reaches its MLP activation
    attention_side_bytes: int  # saved by a block's attention side, alive when backward reaches the kernel
    attention_backward_transient_bytes: int  # gradients of the s*s probabilities and scores (math path)

    @property
    def per_layer_bytes(self) -> int:
        return sum(t.num_bytes for t in self.per_layer)

    @property
    def embedding_bytes(self) -> int:
        return sum(t.num_bytes for t in self.embedding)

    @property
    def head_bytes(self) -> int:
        return sum(t.num_bytes for t in self.head)


@dataclass(frozen=True)
class _Sizes:
    """Element counts for one micro-batch and element sizes for the scenario."""

    H: int
    I: int
    Q: int
    KV: int
    S2: int
    LSE: int
    T: int
    V: int  # b*s*vocab: logits
    seq: int
    compute: int  # bytes per element of linear/attention/activation tensors
    autocast: bool
    residual: int  # bytes per element of the residual stream and LayerNorm inputs
    cuda: bool


def _sizes(shape: ModelShape, scenario: Scenario) -> _Sizes:
    b, s = scenario.batch_size, scenario.seq_len
    compute = 2 if scenario.autocasts or scenario.precision is Precision.BF16 else 4  # fp16-mixed on a CPU: fp32
    residual = 2 if scenario.precision is Precision.BF16 else 4
    return _Sizes(
        H=b * s * shape.hidden_size,
        I=b * s * shape.intermediate_size,
        Q=b * s * shape.num_heads * shape.head_dim,
        KV=b * s * shape.num_kv_heads * shape.head_dim,
        S2=b * shape.num_heads * s * s,
        LSE=b * shape.num_heads * s,
        T=b * s,
        # The per-token logits: the vocabulary's, or a token classifier's labels (its head is
        # otherwise an LM head's: a linear over b*s*h whose logits the loss upcasts to fp32,
        # transformers.loss.loss_utils.ForTokenClassification).
        V=b * s * (shape.num_labels if scenario.task is Task.TOKEN_CLASSIFICATION else shape.vocab_size),
        seq=s,
        compute=compute,
        autocast=scenario.autocasts,
        residual=residual,
        cuda=scenario.device is Device.CUDA,
    )


def _mask_bytes(z: _Sizes, elements: int, input_bytes: int) -> int:
    return elements * (1 if z.cuda else input_bytes)


def _dropout(z: _Sizes, p: float, elements: int, input_bytes: int, name: str) -> list[ActivationTerm]:
    if p <= 0:
        return []
    return [ActivationTerm(name, _mask_bytes(z, elements, input_bytes),
                           "dropout mask: 1 B/elem on CUDA (native_dropout), input-sized on CPU (_dropout_impl)")]


def _activation_function_saved_elements(activation: str, z: _Sizes) -> int:
    """Elements the activation function saves, beyond the next linear's input."""
    name = activation.lower()
    if name == "relu":
        return 0  # ReLU saves its output, which is the next linear's input (same tensor)
    if name in ("gelu_new", "gelu_fast"):
        # transformers NewGELUActivation is Python: 0.5*x*(1+tanh(c*(x+0.044715*x**3)))
        # saves x, tanh's output, 0.5*x and (1+tanh): four I-sized tensors.
        return 4 * z.I
    return z.I  # gelu, gelu_pytorch_tanh, silu: the input


def _math_path(shape: ModelShape, scenario: Scenario, z: _Sizes) -> bool:
    """True when attention materialises the s*s scores: eager, or CPU SDPA with dropout."""
    return scenario.attention is Attention.EAGER or (shape.attention_dropout > 0 and not z.cuda)


def _attention_core(shape: ModelShape, scenario: Scenario, z: _Sizes) -> list[ActivationTerm]:
    """What attention saves: q, k, v and what its kernel keeps."""
    dropout = shape.attention_dropout
    qkv_elements = z.Q + 2 * z.KV
    if scenario.attention is Attention.SDPA and _math_path(shape, scenario, z):
        # CPU SDPA with dropout falls back to the math kernel, which computes in fp32 (its
        # "opmath" type) whatever the input dtype: fp32 copies of q, k, v, the softmax
        # output, the dropout mask and the dropped probabilities (Korthikanti's 5as^2b, at
        # 4 bytes each). Measured: GPT-2/DistilBERT shapes, fp32 and bf16.
        return [
            ActivationTerm("q, k, v (fp32 in the math kernel)", qkv_elements * FP32, "math SDPA saves q, k, v"),
            ActivationTerm("attention probabilities (softmax output)", z.S2 * FP32, "softmax saves its output"),
            ActivationTerm("attention-probability dropout mask", z.S2 * FP32, "input-sized on CPU (_dropout_impl)"),
            ActivationTerm("dropped probabilities (P@V input)", z.S2 * FP32, "matmul(P, V) saves P"),
        ]
    if scenario.attention is Attention.EAGER:
        # Transformers' eager attention repeats grouped K/V heads (repeat_kv) before the
        # matmuls, which save the repeated copies: k and v at the query's size.
        qkv_elements = 3 * z.Q
    terms = [ActivationTerm("q, k, v projections", qkv_elements * z.compute, "attention saves q, k, v")]
    if scenario.attention is Attention.EAGER:
        # Transformers' eager attention: softmax in fp32 (or the input dtype), dropout, P@V.
        softmax_bytes = FP32 if scenario.precision is not Precision.BF16 else 2
        terms.append(ActivationTerm("attention probabilities (softmax output)", z.S2 * softmax_bytes,
                                    "eager attention saves softmax output for its backward"))
        if dropout > 0:
            terms += _dropout(z, dropout, z.S2, softmax_bytes, "attention-probability dropout mask")
            terms.append(ActivationTerm("dropped probabilities (P@V input)", z.S2 * z.compute,
                                        "matmul(P, V) saves P"))
        return terms
    # Flash / memory-efficient SDPA (CUDA, and CPU without dropout): output and log-sum-exp.
    return terms + [
        ActivationTerm("attention output (SDPA)", z.Q * z.compute, "SDPA flash/efficient backward needs out"),
        ActivationTerm("log-sum-exp (SDPA)", z.LSE * FP32, "SDPA flash/efficient saves logsumexp (fp32)"),
    ]


def _layernorm(z: _Sizes, name: str) -> list[ActivationTerm]:
    return [ActivationTerm(f"{name} input", z.H * z.residual, "native_layer_norm saves input"),
            ActivationTerm(f"{name} mean and rstd", 2 * z.T * FP32, "native_layer_norm saves mean, rstd")]


def _rmsnorm(z: _Sizes, name: str) -> list[ActivationTerm]:
    # LlamaRMSNorm.forward: x.to(fp32); x * rsqrt(mean(x**2) + eps); weight * x.to(dtype).
    normalized = z.H * (FP32 if z.residual == FP32 else 2)
    return [ActivationTerm(f"{name} input (fp32)", z.H * FP32, "pow and mul save the fp32 input"),
            ActivationTerm(f"{name} normalized", normalized, "weight * x saves x"),
            ActivationTerm(f"{name} rsqrt", z.T * FP32, "mul saves rsqrt(var + eps)")]


def _linear_input(z: _Sizes, elements: int, name: str, consumers: int = 1) -> ActivationTerm:
    """What the linear layers reading one tensor save of it.

    Without autocast they all save the same tensor. Autocast casts the input once per
    linear (its cache holds only leaf tensors, i.e. weights), so each of `consumers`
    linears saves its own 16-bit copy (measured: tests/test_activation_model.py).
    """
    copies = consumers if z.autocast else 1
    return ActivationTerm(name, copies * elements * z.compute, "linear saves its input (autocast: one 16-bit copy per linear)")


def _plain_mlp(shape: ModelShape, z: _Sizes) -> list[ActivationTerm]:
    terms = [_linear_input(z, z.H, "MLP input (fc1 input)")]
    act = _activation_function_saved_elements(shape.activation, z)
    if act:
        terms.append(ActivationTerm(f"{shape.activation} saved tensors", act * z.compute, "activation backward"))
    terms.append(_linear_input(z, z.I, "fc2 input"))
    return terms


def _gated_mlp(shape: ModelShape, z: _Sizes) -> list[ActivationTerm]:
    # down(act(gate(x)) * up(x)): act saves gate(x); mul saves act(...) and up(x); down saves the product.
    return [
        _linear_input(z, z.H, "MLP input (gate/up input)", consumers=2),
        ActivationTerm("gate projection", z.I * z.compute, "activation saves its input"),
        ActivationTerm("activated gate", z.I * z.compute, "mul saves both factors"),
        ActivationTerm("up projection", z.I * z.compute, "mul saves both factors"),
        _linear_input(z, z.I, "down projection input"),
    ]


def _attention_terms(shape: ModelShape, scenario: Scenario, z: _Sizes) -> list[ActivationTerm]:
    family = shape.family
    # GPT-2 (c_attn) and GPT-NeoX (query_key_value) project q, k, v with one fused linear;
    # Phi's q, k, v and fc1 all read the same LayerNorm output.
    fused_qkv = family in (ArchFamily.GPT2, ArchFamily.GPT_NEOX)
    readers = 1 if fused_qkv else 3
    if family is ArchFamily.PHI:
        readers += 1
    attention = [_linear_input(z, z.H, "q/k/v projection input", consumers=readers)]
    attention += _attention_core(shape, scenario, z)
    partial_rotary = 0 < shape.rotary_fraction < 1
    if fused_qkv and shape.rotary_fraction > 0:
        # GPT-NeoX: v stays a view of the fused qkv output (so all of it stays saved) and
        # rotary builds q and k anew (cat of rotated and pass-through parts).
        attention.append(ActivationTerm("rotated q, k (new tensors beside the fused qkv)", (z.Q + z.KV) * z.compute,
                                        "attention saves the concatenated q, k"))
    if _math_path(shape, scenario, z) or partial_rotary:
        attention.append(_linear_input(z, z.Q, "output projection input"))
    # else: SDPA's output keeps its inputs' (b, s, a, d) memory layout, so
    # transpose(1, 2).reshape(b, s, h) is a view and the output projection saves the same
    # storage. Partial rotary concatenates q and k into (b, a, s, d) layout, and the
    # output then needs a copy (measured on GPT-NeoX and Phi shapes).
    return attention


def _pre_attention_norm(shape: ModelShape, z: _Sizes) -> list[ActivationTerm]:
    """The norm a block applies before its attention (post-LN encoders apply none)."""
    if shape.family is ArchFamily.ENCODER:
        return []
    if shape.family is ArchFamily.LLAMA:
        return _rmsnorm(z, "input RMSNorm")
    if shape.family in (ArchFamily.GPT_NEOX, ArchFamily.PHI):
        return _layernorm(z, "input LayerNorm")
    return _layernorm(z, "attention LayerNorm")


def _attention_side_bytes(shape: ModelShape, scenario: Scenario, z: _Sizes) -> int:
    """Saved bytes of a block still alive when its backward reaches the attention kernel:
    the attention's own tensors and the norm before it (the MLP side is freed by then)."""
    return sum(t.num_bytes for t in _pre_attention_norm(shape, z) + _attention_terms(shape, scenario, z))


def _block_terms(shape: ModelShape, scenario: Scenario, z: _Sizes) -> list[ActivationTerm]:
    family = shape.family
    # Rotary embeddings (q*cos + rotate_half(q)*sin) save only cos and sin: mul saves the
    # other factor, and cos/sin do not require grad. Their cost is counted once per model.
    attention = _attention_terms(shape, scenario, z)
    hidden_p = shape.hidden_dropout
    if family is ArchFamily.ENCODER:  # post-LN: attn -> dropout -> add -> LN -> MLP -> dropout -> add -> LN
        # DistilBERT's attention has no dropout after its output projection (modeling_distilbert.py).
        attention_output_p = 0.0 if shape.model_type == "distilbert" else hidden_p
        return (attention + _dropout(z, attention_output_p, z.H, z.compute, "attention output dropout mask")
                + _layernorm(z, "attention LayerNorm") + _plain_mlp(shape, z)
                + _dropout(z, hidden_p, z.H, z.compute, "MLP output dropout mask") + _layernorm(z, "output LayerNorm"))
    if family is ArchFamily.LLAMA:
        return (_pre_attention_norm(shape, z) + attention + _rmsnorm(z, "post-attention RMSNorm")
                + _gated_mlp(shape, z))
    if family in (ArchFamily.GPT_NEOX, ArchFamily.PHI):  # parallel residual: both branches read x
        norms = _pre_attention_norm(shape, z)
        if family is ArchFamily.GPT_NEOX:  # a second LayerNorm reads the same input: only its stats are new
            norms.append(ActivationTerm("post-attention LayerNorm mean and rstd", 2 * z.T * FP32,
                                        "native_layer_norm saves mean, rstd"))
        mlp = _plain_mlp(shape, z)[1:] if family is ArchFamily.PHI else _plain_mlp(shape, z)
        return (norms + attention + mlp + _dropout(z, hidden_p, z.H, z.compute, "attention dropout mask")
                + _dropout(z, hidden_p, z.H, z.compute, "MLP dropout mask"))
    # GPT-2, OPT and unknown families: pre-LN, sequential residual.
    return (_pre_attention_norm(shape, z) + attention
            + _dropout(z, hidden_p, z.H, z.compute, "attention output dropout mask")
            + _layernorm(z, "MLP LayerNorm") + _plain_mlp(shape, z)
            + _dropout(z, hidden_p, z.H, z.compute, "MLP output dropout mask"))


def _embedding_terms(shape: ModelShape, z: _Sizes) -> list[ActivationTerm]:
    terms: list[ActivationTerm] = []
    if shape.family is ArchFamily.ENCODER:
        terms += _layernorm(z, "embedding LayerNorm")
    terms += _dropout(z, shape.embedding_dropout, z.H, z.residual, "embedding dropout mask")
    if shape.rotary_fraction > 0:
        rotary_dim = int(shape.head_dim * shape.rotary_fraction)
        terms.append(ActivationTerm("rotary cos and sin", 2 * z.seq * rotary_dim * z.residual,
                                    "computed once per forward for position_ids of shape (1, s); saved by mul"))
    return terms


def _head_terms(shape: ModelShape, scenario: Scenario, z: _Sizes) -> list[ActivationTerm]:
    b = scenario.batch_size
    if scenario.task is Task.SEQUENCE_CLASSIFICATION:
        # The pooler/classifier reads a slice of the last hidden state; a saved view keeps
        # the whole (b, s, h) tensor alive. Pooler dense + tanh + classifier inputs are b*h each.
        terms = [ActivationTerm("pooler/classifier inputs", 3 * b * shape.hidden_size * z.compute,
                                "dense, tanh and classifier save b*h each")]
        if not z.autocast:  # autocast saves a 16-bit copy of the slice instead of the view
            terms.insert(0, ActivationTerm("last hidden state (kept by the pooled slice)", z.H * z.residual,
                                           "a saved view keeps its base alive"))
        return terms
    final_norm = (_rmsnorm(z, "final RMSNorm") if shape.family is ArchFamily.LLAMA
                  else _layernorm(z, "final LayerNorm"))
    terms = list(final_norm) if shape.family is not ArchFamily.ENCODER else []
    if scenario.task is Task.MASKED_LM:  # transform: dense -> gelu -> LayerNorm -> decoder
        terms += [_linear_input(z, z.H, "MLM transform input"),
                  ActivationTerm("MLM transform activation input", z.H * z.compute, "gelu saves its input")]
        terms += _layernorm(z, "MLM transform LayerNorm")
    terms += [_linear_input(z, z.H, "LM head input"),
              ActivationTerm("log-softmax output (fp32)", z.V * FP32,
                             "cross_entropy upcasts logits to fp32 (ForCausalLMLoss) and log_softmax saves its result")]
    return terms


def _output_logits_bytes(shape: ModelShape, scenario: Scenario, z: _Sizes) -> int:
    """The logits in the model's output: b*s*V for language models, b*labels for classifiers.

    Under mixed precision Accelerate wraps forward in `convert_outputs_to_fp32`
    (accelerate.utils.operations), so the returned logits are an fp32 copy.
    """
    elements = z.V if scenario.task is not Task.SEQUENCE_CLASSIFICATION else scenario.batch_size * shape.num_labels
    return elements * (FP32 if z.autocast else z.compute)


def activation_profile(shape: ModelShape, scenario: Scenario) -> ActivationProfile:
    z = _sizes(shape, scenario)
    block = tuple(_block_terms(shape, scenario, z))
    is_lm = scenario.task is not Task.SEQUENCE_CLASSIFICATION
    # While the loss runs, the 16-bit logits and their fp32 copy (`logits.float()` in
    # ForCausalLMLoss) coexist; under autocast the output then becomes that fp32 copy's
    # twin (convert_outputs_to_fp32), so the extra is the 16-bit logits; in pure bf16 it
    # is the fp32 copy. fp32 runs make no copy.
    if not is_lm or z.compute == FP32:
        logits_upcast = 0
    else:
        logits_upcast = z.V * (z.compute if z.autocast else FP32)
    # Loss backward: nll_loss's dense fp32 gradient and log_softmax's input gradient coexist.
    loss_backward = 2 * z.V * FP32 if is_lm else 0
    math_path = _math_path(shape, scenario, z)
    softmax_bytes = FP32 if (scenario.attention is Attention.SDPA or scenario.precision is not Precision.BF16) else 2
    return ActivationProfile(
        embedding=tuple(_embedding_terms(shape, z)),
        per_layer=block,
        head=tuple(_head_terms(shape, scenario, z)),
        checkpoint_input_bytes=z.H * z.residual,
        # Eager attention in decoders gets a materialised (b, 1, s, s) causal mask in the
        # model's dtype; non-reentrant checkpointing keeps it as an input of every block
        # (one shared tensor) until backward is done. Measured on a LLaMA shape.
        checkpoint_mask_bytes=(scenario.batch_size * scenario.seq_len ** 2 * z.residual
                               if scenario.attention is Attention.EAGER and shape.family is not ArchFamily.ENCODER
                               else 0),
        output_logits_bytes=_output_logits_bytes(shape, scenario, z),
        loss_forward_transient_bytes=logits_upcast,
        loss_backward_transient_bytes=loss_backward,
        # Inside a block's backward the gradients of its largest intermediate (output and
        # input of the op) coexist: 2 x I measured on a checkpointed DistilBERT shape.
        layer_backward_transient_bytes=2 * max(z.I, z.H) * z.compute,
        attention_side_bytes=_attention_side_bytes(shape, scenario, z),
        # At the math kernel's backward: the gradient w.r.t. the probabilities (fp32, the
        # kernel's opmath) and w.r.t. the scores (in the compute dtype): measured on
        # DistilBERT shapes, fp32 and autocast.
        attention_backward_transient_bytes=z.S2 * (softmax_bytes + z.compute) if math_path else 0,
        # Inside the last block's MLP backward: the gradients of the activation's output
        # and input (2 x I) and the residual branch's gradient (H) are alive, while the
        # block's tail (closing norm and the MLP's second linear input) is freed already;
        # measured on DistilBERT shapes, fp32 and bf16 (tests/test_activation_model.py).
        block_backward_start_transient_bytes=2 * z.I * z.compute + z.H * z.residual,
        # Arriving at a recomputed block, the whole block still saved: the recomputed
        # block output and the gradients of the block output, the residual branch and the
        # closing norm's input, residual-stream sized: the peak of checkpointed encoders
        # under autocast (measured on DistilBERT shapes: 3-4 H).
        block_entry_transient_bytes=4 * z.H * z.residual,
        # The MLP's second linear input (and a post-LN block's closing LayerNorm) are
        # freed before the activation's backward, where a recomputed block peaks.
        block_tail_bytes=z.I * z.compute + (z.H * z.residual + 2 * z.T * FP32
                                            if shape.family is ArchFamily.ENCODER else 0),
    )
