"""Hugging Face interop (`cutp.models.hf`): read a model directory straight into this rank's shards,
write one transformers loads. This module is the public name of it."""
from .models.hf import (HFFormatError, config_from_hf, config_to_hf, expected_shapes, check_state_dict,  # noqa: F401
                        from_hf, from_hf_gpt2, load_hf_gpt2, load_hf_into, read_hf_config, save_hf, save_hf_gpt2)
from .models.hf_llama import (config_from_hf_llama, config_to_hf_llama, from_hf_llama, hf_state_dict,  # noqa: F401
                              load_hf_llama, save_hf_llama)
