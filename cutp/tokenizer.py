"""The former home of the tokenizers, kept so that `from cutp.tokenizer import get_tokenizer` goes on
working: they live in `cutp.data.tokenizer` now (GPT-2's hand-written BPE gave way to the
`tokenizers` library's, `HFTokenizer`)."""
from .data.tokenizer import ByteTokenizer, HFTokenizer, get_tokenizer, load_tokenizer  # noqa: F401
