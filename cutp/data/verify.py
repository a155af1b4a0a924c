"""`python -m cutp verify-data DIR`: every shard of a prepared directory read whole and checked
against its meta.json: the header and the size (as opening the data always checks), the token
count, the blake2b digest prepare-data recorded, and every id below the vocabulary size; the
document lengths and target masks beside them (format version 2) by their headers, counts and
digests. One line
per damaged shard, then one summary line; exit status 0 when all is intact, 1 otherwise.
`--verify-data` runs the same check before a training run (cutp.train.config).

The digest is of the shard's tokens as stored (little-endian), read in blocks of 16 MiB: a
shard of any size is checked in constant memory, at the disk's speed.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys

import numpy as np

from ..runtime.errors import ConfigError, UserError
from .shards import DOCS_EXT, HEADER_BYTES, MASK_EXT, SPLITS, read_meta, read_side, shard_header

BLOCK_BYTES = 16 << 20


def shard_problem(path: str, expected: dict, vocab_size: int) -> str | None:
    """What is wrong with one shard (`expected`: its entry in meta.json), or None."""
    if not os.path.isfile(path):
        return f"{path}: missing"
    found = shard_header(path)
    if found is None:
        return f"{path}: not a complete token shard (its header or its size is wrong)"
    dtype, count = found
    if count != expected["tokens"]:
        return f"{path}: {count:,} tokens, meta.json says {expected['tokens']:,}"
    digest = hashlib.blake2b(digest_size=16)
    bad = None
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        at = 0
        while True:
            block = f.read(BLOCK_BYTES - BLOCK_BYTES % dtype.itemsize)
            if not block:
                break
            digest.update(block)
            if bad is None:
                ids = np.frombuffer(block, dtype.newbyteorder("<"))
                over = np.flatnonzero(ids >= vocab_size)
                if over.size:
                    bad = (at + int(over[0]), int(ids[over[0]]))
            at += len(block) // dtype.itemsize
    if digest.hexdigest() != expected.get("blake2b"):
        where = f"; token {bad[0]:,} is id {bad[1]}, outside the vocabulary of {vocab_size:,}" if bad else ""
        return f"{path}: its blake2b digest differs from meta.json's (the shard was changed after prepare-data{where})"
    if bad:
        return f"{path}: token {bad[0]:,} is id {bad[1]}, outside the vocabulary of {vocab_size:,}"
    return None


def side_problem(path: str, expected: dict, ext: str) -> str | None:
    """What is wrong with a mask or document-length file beside the shards (format version 2), or None."""
    try:
        values = read_side(path, ext)
    except ConfigError as e:
        return str(e).split(";")[0]
    if len(values) != expected["tokens"]:
        return f"{path}: {len(values):,} entries, meta.json says {expected['tokens']:,}"
    if hashlib.blake2b(np.ascontiguousarray(values).tobytes(), digest_size=16).hexdigest() != expected.get("blake2b"):
        return f"{path}: its blake2b digest differs from meta.json's (the file was changed after prepare-data)"
    if ext == MASK_EXT and len(values) and int(values.max()) > 1:
        return f"{path}: a target flag is {int(values.max())}, not 0 or 1"
    return None


def verify_prepared(directory: str) -> tuple[list, int, int]:
    """(the problems, one line per damaged shard; the shards; the tokens) of a prepared directory.
    Raises ConfigError when meta.json itself cannot be read."""
    meta = read_meta(directory)
    problems, shards, tokens = [], 0, 0
    for split in SPLITS:
        for shard in meta["splits"][split]["shards"]:
            shards += 1
            tokens += int(shard["tokens"])
            problem = shard_problem(os.path.join(directory, shard["file"]), shard, int(meta["vocab_size"]))
            if problem:
                problems.append(problem)
        for key, ext in (("docs", DOCS_EXT), ("masks", MASK_EXT)):
            for entry in meta["splits"][split].get(key) or []:
                problem = side_problem(os.path.join(directory, entry["file"]), entry, ext)
                if problem:
                    problems.append(problem)
    return problems, shards, tokens


def fix_line(directory: str) -> str:
    return f"prepare the data again (python -m cutp prepare-data INPUTS --tokenizer ... --out {directory} --overwrite)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cutp verify-data",
                                description="Checks every shard of a prepared directory against its meta.json: "
                                            "header, size, token count, blake2b digest, ids within the vocabulary.")
    p.add_argument("directory", metavar="DIR", help="a directory written by python -m cutp prepare-data")
    args = p.parse_args(argv)
    try:
        problems, shards, tokens = verify_prepared(args.directory)
    except UserError as e:
        print(f"verify-data: error: {e}", file=sys.stderr)
        return 1
    for line in problems:
        print(f"verify-data: {line}", file=sys.stderr)
    if problems:
        print(f"verify-data: error: {len(problems)} of {shards} shard(s) damaged in {args.directory}; "
              f"{fix_line(args.directory)}", file=sys.stderr)
        return 1
    print(f"verify-data: {args.directory}: {shards} shard(s), {tokens:,} tokens: every digest matches meta.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
