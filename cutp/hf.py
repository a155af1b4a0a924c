"""Hugging Face interop (`cutp.models.hf`): read a model directory of any family straight into this
rank's shards, write one that transformers loads as the source's class. This module is the public
name of it; the families are `cutp.models.families`."""
from .models.families import FAMILIES, family_for_hf, family_of, model_types  # noqa: F401
from .models.hf import (HFFormatError, check_state_dict, config_from_hf, config_from_hf_llama,  # noqa: F401
                        config_to_hf, config_to_hf_llama, expected_shapes, from_hf, from_hf_gpt2, from_hf_llama,
                        generation_config, hf_state_dict, load_hf, load_hf_gpt2, load_hf_into, load_hf_llama,
                        read_hf_config, save_hf, save_hf_gpt2, save_hf_llama)
