"""The models cutp trains, built from its tensor-parallel layers.

config    GPTConfig / ModelConfig (the one spec every layer is built from: GPT-2, Llama, Qwen2,
          Mistral, Mixtral), PRESETS, DTYPES
gpt       GPT: the model of one rank (its pipeline stage), forward, backward, generation, state
stages    which layers each pipeline stage (and interleaved model chunk) holds
hf        Hugging Face interop: GPT-2's adapter, and from_hf / save_hf for every family
hf_llama  the Llama family's adapter (LlamaForCausalLM, Qwen2, Mistral, Mixtral)
hf_files  Hugging Face directories: config.json and safetensors files, shared by the adapters
"""
from .config import DTYPES, PRESETS, GPTConfig, ModelConfig
from .gpt import GPT, PositionEmbedding
from .stages import near_even, stage_layers, virtual_stage_layers

__all__ = ["DTYPES", "PRESETS", "GPTConfig", "ModelConfig", "GPT", "PositionEmbedding", "near_even", "stage_layers",
           "virtual_stage_layers"]
