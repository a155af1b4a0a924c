"""The models cutp trains, built from its tensor-parallel layers.

config   GPTConfig (one config object every layer is built from), PRESETS, DTYPES
gpt      GPT: the model of one rank (its pipeline stage), forward, backward, generation, state
stages   which layers each pipeline stage (and interleaved model chunk) holds
hf       Hugging Face interop: config.json and safetensors directories in and out
"""
from .config import DTYPES, PRESETS, GPTConfig, ModelConfig
from .gpt import GPT, PositionEmbedding
from .stages import near_even, stage_layers, virtual_stage_layers

__all__ = ["DTYPES", "PRESETS", "GPTConfig", "ModelConfig", "GPT", "PositionEmbedding", "near_even", "stage_layers",
           "virtual_stage_layers"]
