"""The former home of the tokenizers, kept so that `from cutp.tokenizer import get_tokenizer` goes on
working: they live in `cutp.data.tokenizer` now."""
from .data.tokenizer import ByteTokenizer, GPT2BPETokenizer, bytes_to_unicode, get_tokenizer  # noqa: F401
