"""1D tensor parallelism (Megatron-LM style) with hand-written forward and backward.

mappings       the communication operators (copy-to-TP, reduce-from-TP, scatter, gather)
layers         ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, ParallelLMHead,
               LayerNorm, RMSNorm, Dropout, LogitSoftcap
attention      ParallelAttention (heads split, GQA)
mlp            ParallelMLP (GeLU, SwiGLU or GeGLU)
specs          the submodules' specs a block is built from (NormSpec, AttentionSpec, MLASpec, MLPSpec,
               MoESpec), each declaring its parameters (ParamDecl: shape, TP split, count)
transformer    BlockSpec (the chosen specs), ParallelTransformerBlock
moe            MoEMLP (router, load-balancing and z-losses, capacity, experts)
cross_entropy  VocabParallelCrossEntropy
sharding       which slice of each full tensor a rank holds
grads          tp_grad_sync (GQA), finish_grad_sync (GQA + DP x CP), global_grad_norm
lora           LoRA adapters on the parallel linears (PEFT's, sharded as its LoraParallelLinear), freeze
"""
from .attention import ParallelAttention
from .cross_entropy import VocabParallelCrossEntropy
from .grads import finish_grad_sync, global_grad_norm, sum_grad_over, tp_grad_sync
from .layers import (ColumnParallelLinear, Dropout, LayerNorm, LogitSoftcap, ParallelLMHead, RMSNorm,
                     RowParallelLinear, VocabParallelEmbedding, make_norm)
from .moe import MoEMLP, check_moe
from .parameter import Module, Parameter, deferred_parameters, make_parameter, normal_init, ones_init, zeros_init
from .random import REPLICATED, SHARDED, RNGTracker
from .sharding import Sharding, gather_full, pad_rows, pad_vocab, take_shard
from .transformer import BlockSpec, ParallelMLP, ParallelTransformerBlock

__all__ = [
    "ParallelAttention", "VocabParallelCrossEntropy", "finish_grad_sync", "global_grad_norm", "tp_grad_sync",
    "sum_grad_over",
    "ColumnParallelLinear", "Dropout", "LayerNorm", "ParallelLMHead", "RowParallelLinear",
    "VocabParallelEmbedding", "pad_vocab", "Module", "Parameter", "deferred_parameters", "make_parameter", "normal_init",
    "ones_init", "zeros_init", "REPLICATED", "SHARDED", "RNGTracker", "Sharding", "gather_full",
    "take_shard", "pad_rows", "ParallelMLP", "ParallelTransformerBlock", "MoEMLP", "check_moe",
    "BlockSpec", "RMSNorm", "make_norm", "LogitSoftcap",
]
