"""Training data: token streams (the embedded default corpus, text files as bytes, token files),
their train/validation split and the batch sampler (`dataset`); tokenizers (`tokenizer`)."""
from .dataset import (DEFAULT_CORPUS_BYTES, BatchSampler, Dataset, default_corpus, load_dataset, micro_batches,
                      stdlib_source_files)
from .tokenizer import ByteTokenizer, GPT2BPETokenizer, get_tokenizer

__all__ = ["DEFAULT_CORPUS_BYTES", "BatchSampler", "Dataset", "default_corpus", "load_dataset", "micro_batches",
           "stdlib_source_files",
           "ByteTokenizer", "GPT2BPETokenizer", "get_tokenizer"]
