"""The former home of the GPT model, kept so that `from cutp.model import GPT, GPTConfig` goes on
working: everything lives in `cutp.models` now."""
from .models import DTYPES, GPT, PRESETS, GPTConfig, PositionEmbedding, stage_layers, virtual_stage_layers  # noqa: F401
