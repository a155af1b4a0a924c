"""Training data: token streams (the embedded default corpus, text files as bytes, token files,
prepared directories of shards), their train/validation split and the batch sampler (`dataset`);
token shards (`shards`); tokenizers (`tokenizer`); chat templates and target masks (`chat`); packing (`packing`);
`python -m cutp prepare-data` (`prepare`)."""
from .dataset import (DEFAULT_CORPUS_BYTES, BatchSampler, Dataset, MicroBatch, default_corpus, load_dataset,
                      micro_batches, model_kwargs, stdlib_source_files)
from .shards import ShardedTokens, read_shard, write_shard
from .tokenizer import ByteTokenizer, HFTokenizer, get_tokenizer, load_tokenizer

__all__ = ["DEFAULT_CORPUS_BYTES", "BatchSampler", "Dataset", "MicroBatch", "default_corpus", "load_dataset",
           "micro_batches", "model_kwargs", "stdlib_source_files", "ShardedTokens", "read_shard", "write_shard", "ByteTokenizer", "HFTokenizer",
           "get_tokenizer", "load_tokenizer"]
