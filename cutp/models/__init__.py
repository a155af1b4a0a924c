"""The models cutp trains, built from its tensor-parallel layers.

config    GPTConfig / ModelConfig (the one spec every layer is built from: GPT-2, Llama, Qwen2,
          Mistral, Mixtral), PRESETS, DTYPES
gpt       GPT: the model of one rank (its pipeline stage), forward, backward, generation, state
stages    which layers each pipeline stage (and interleaved model chunk) holds
families  one module per family (gpt2, llama, qwen2, mistral, mixtral): its Hugging Face names,
          config mapping and tensor recipes both ways, presets; the registry by model_type
hf        Hugging Face interop for every family: from_hf / save_hf / load_hf_into (shared code)
hf_files  Hugging Face directories: config.json and safetensors files, atomic writes
"""
from .config import DTYPES, PRESETS, GPTConfig, ModelConfig
from . import families  # noqa: F401  (registers the families' presets)
from .gpt import GPT, PositionEmbedding
from .stages import near_even, stage_layers, virtual_stage_layers

__all__ = ["DTYPES", "PRESETS", "GPTConfig", "ModelConfig", "GPT", "PositionEmbedding", "near_even", "stage_layers",
           "virtual_stage_layers"]
