"""The optimizer side of a training step.

flat          FlatParameters: parameters and gradients in one buffer each (float32 gradients
              for 16-bit models), weight decay as a range
adamw         AdamW (every DP rank holds the state) and DistributedAdamW (state sharded over DP,
              ZeRO-1), both with float32 master weights for 16-bit models
expert_parallel  ExpertParallelAdamW: the distributed optimizer of an expert-parallel model
              (dense state sharded over DP, the experts' over the expert-DP group)
loss_scaler   LossScaler (static) and DynamicLossScaler (float16 training)
schedule      the learning-rate schedule and the clipping factor
sharded       ShardedAdamW: ZeRO-2 (gradients sharded too, reduce-scattered unit by unit in every
              micro-batch) and ZeRO-3 (parameters too, each unit gathered for its forward and backward)
buckets       GradBuckets: the DP gradient reduction in buckets started during the backward
              (--overlap-grad-reduce); ParamGather: the distributed optimizer's parameter
              gather per bucket during the next forward (--overlap-param-gather);
              GradBucketGroups, ParamGathers: the dense and the expert sets as one (ep > 1)
"""
from .adamw import GRAD_REDUCE_DTYPES, AdamW, DistributedAdamW
from .buckets import GradBucketGroups, GradBuckets, ParamGather, ParamGathers, default_bucket_size
from .expert_parallel import ExpertParallelAdamW, FlatParts
from .flat import FlatParameters, grad_dtype_for, is_low_precision, state_dtype_for
from .loss_scaler import DynamicLossScaler, LossScaler, describe_scaler
from .sharded import ShardedAdamW
from .schedule import clip_scale, lr_schedule

__all__ = ["GRAD_REDUCE_DTYPES", "AdamW", "DistributedAdamW", "ExpertParallelAdamW", "GradBucketGroups",
           "GradBuckets", "ParamGather", "ParamGathers", "default_bucket_size", "FlatParameters", "FlatParts",
           "grad_dtype_for",
           "is_low_precision", "state_dtype_for", "DynamicLossScaler", "LossScaler", "ShardedAdamW", "clip_scale",
           "describe_scaler", "lr_schedule"]
