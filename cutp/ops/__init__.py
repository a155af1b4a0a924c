"""Core numerical ops: hand-written forward and backward, array-module generic (NumPy/CuPy).

Convention: ``*_forward(...) -> (out, ctx)``; ``*_backward(dout, ctx) -> grads``. ctx holds
exactly what the backward needs. float32/float64 compute in their own precision; bfloat16
(ml_dtypes) computes in float32 and returns bfloat16 outputs (statistics stay float32).
"""
from .adamw import adamw_update
from .attention import (
    AttentionCtx,
    causal_attention_backward,
    causal_attention_forward,
    causal_attention_reference,
    flash_attention_backward,
    flash_attention_forward,
)
from .cross_entropy import (
    CrossEntropyCtx,
    ce_rescale_sum,
    ce_shard_backward,
    ce_shard_forward,
    cross_entropy_backward,
    cross_entropy_forward,
)
from .dropout import (
    DropoutCtx,
    dropout_backward,
    dropout_forward,
    dropout_forward_mask,
    dropout_forward_rows,
    dropout_mask,
    dropout_mask_at,
    keep_threshold,
    random_bits,
    splitmix64_reference,
)
from .embedding import EmbeddingCtx, embedding_backward, embedding_forward
from .erf import erf, erfc  # the functions: `cutp.ops.erf` names erf, not its module
from .gemm import allow_tf32, column_sums, gemm, on_cublas, tf32_allowed
from .gemm import operand as gemm_operand
from .gelu import GeluCtx, bias_gelu_backward, bias_gelu_forward, gelu_backward, gelu_forward
from .geglu import GeGLUCtx, geglu_backward, geglu_forward
from .layernorm import LayerNormCtx, layernorm_backward, layernorm_forward
from .linear import LinearCtx, linear_backward, linear_forward
from .rmsnorm import RMSNormCtx, residual_rmsnorm_forward, rmsnorm_backward, rmsnorm_forward
from .rotary import (
    ROPE_TYPES,
    RopeScaling,
    RotaryCtx,
    rope_inv_freq,
    rope_tables,
    rotary_backward,
    rotary_forward,
)
from .softcap import SoftcapCtx, softcap_backward, softcap_forward
from .softmax import SoftmaxCtx, causal_mask, softmax_backward, softmax_forward
from .swiglu import SwiGLUCtx, swiglu_backward, swiglu_forward

__all__ = [
    "adamw_update",
    "AttentionCtx", "causal_attention_backward", "causal_attention_forward", "causal_attention_reference",
    "flash_attention_backward", "flash_attention_forward",
    "CrossEntropyCtx", "ce_rescale_sum", "ce_shard_backward", "ce_shard_forward",
    "cross_entropy_backward", "cross_entropy_forward",
    "DropoutCtx", "dropout_backward", "dropout_forward", "dropout_forward_rows", "dropout_mask", "keep_threshold",
    "dropout_forward_mask", "dropout_mask_at",
    "random_bits", "splitmix64_reference",
    "EmbeddingCtx", "embedding_backward", "embedding_forward",
    "erf", "erfc",
    "allow_tf32", "column_sums", "gemm", "gemm_operand", "on_cublas", "tf32_allowed",
    "GeluCtx", "bias_gelu_backward", "bias_gelu_forward", "gelu_backward", "gelu_forward",
    "GeGLUCtx", "geglu_backward", "geglu_forward",
    "LayerNormCtx", "layernorm_backward", "layernorm_forward",
    "LinearCtx", "linear_backward", "linear_forward",
    "RMSNormCtx", "residual_rmsnorm_forward", "rmsnorm_backward", "rmsnorm_forward",
    "ROPE_TYPES", "RopeScaling", "RotaryCtx", "rope_inv_freq", "rope_tables", "rotary_backward", "rotary_forward",
    "SoftcapCtx", "softcap_backward", "softcap_forward",
    "SoftmaxCtx", "causal_mask", "softmax_backward", "softmax_forward",
    "SwiGLUCtx", "swiglu_backward", "swiglu_forward",
]
