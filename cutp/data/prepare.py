"""`python -m cutp prepare-data INPUT... --tokenizer DIR|bytes --out DIR`: text to token shards.

    python -m cutp prepare-data corpus/ notes.txt docs.jsonl --tokenizer path/to/Llama-3.2-1B --out data/llama

Inputs: text files (one document each), JSONL files (one document a line, its `--text-key`
string; blank lines skipped) and folders of them (walked in sorted order, hidden names skipped;
`.jsonl` files read as JSONL, all others as text). Everything is UTF-8.

`--format chat|instruct` reads JSONL records of messages (cutp.data.records) and renders each
with the tokenizer's chat template (cutp.data.chat: ids as transformers' apply_chat_template
gives them, no EOS appended: the template ends each turn); `--train-on` decides the targets,
stored as one uint8 flag per token beside the shards (`<split>_NNNNNN.mask`). A record without a
target, or longer than `--max-seq-len`, is counted, reported and dropped or truncated
(`--too-long`; meta.json's "dropped"). Every preparation also stores each document's length
(`<split>_NNNNNN.docs`, for packing). Both streams are cut, synced and resumed as the tokens are.

Each text document is encoded by the tokenizer (`cutp.data.tokenizer.load_tokenizer`) with its
template's BOS where it adds one (Llama, Mistral) and EOS appended (the byte tokenizer has none:
its documents are concatenated as they are). Special tokens written in a document's text are
encoded as text, never as their ids (a document cannot forge an EOS). Document i (counting from
0 in input order) goes to the validation split when ceil((i+1) f) > ceil(i f) for f =
`--val-fraction`: ceil(n f) whole documents, spread evenly, the first among them; the rest to
train. Each split is one token stream cut into shards of `--shard-tokens` tokens (the last
shorter), written by `cutp.data.shards.write_shard` (llm.c's layout; uint16 when the
vocabulary fits, else uint32), then meta.json. The output is a function of the inputs and the
settings alone: the same bytes for any `--workers`.

Workers (`--workers`, default the cores) encode batches of documents in processes, each
single-threaded; the main process reads the inputs and writes the shards, in input order.

Resuming: each split's tokens are appended to its next shard's temporary file, renamed to the
shard when full (`cutp.data.shards.ShardWriter`). After each batch that finished a shard, and
every PROGRESS_SECONDS, progress.json records the settings, the next document to encode and how
many tokens each temporary file holds (synced first). Running the same command again after a
kill goes on from there: finished shards kept, the temporary files cut back to what was
recorded, the documents before read but not encoded; its result is identical to an
uninterrupted run. An --out holding a finished preparation, or an unfinished one of other
settings or inputs, is refused without `--overwrite` (which deletes this tool's files there).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import sys
import time
from dataclasses import asdict

import numpy as np

from ..runtime.errors import ConfigError, UserError
from .chat import ChatError, ChatTemplate, encode_chat
from .records import FORMATS, TOO_LONG, TRAIN_ON, RecordSettings, documents, input_files, records_of  # noqa: F401
from .shards import DOCS_EXT, FORMAT, FORMAT_VERSION, MASK_EXT, META_FILE, SPLITS, ShardWriter, token_dtype
from .tokenizer import BYTES, ByteTokenizer, load_tokenizer


PROGRESS_FILE = "progress.json"
BATCH_BYTES = 1 << 20  # text per task sent to a worker
PROGRESS_SECONDS = 10  # progress.json is rewritten at least this often (and after each shard)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m cutp prepare-data",
                                description="Text files, JSONL files and folders of them to token shards for "
                                            "training with --data DIR (cutp.data.prepare's docstring has the rules).")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, JSONL files, folders of them")
    p.add_argument("--tokenizer", required=True, metavar="DIR|bytes", help="a model directory with tokenizer.json (or GPT-2's "
                   "vocab.json + merges.txt), or 'bytes'")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to write (meta.json and the shards)")
    p.add_argument("--text-key", default="text", metavar="KEY", help="the key of a JSONL line's text (default: text)")
    p.add_argument("--format", default="text", choices=FORMATS, help="text: documents; chat: JSONL records of "
                   "\"messages\": [{role, content}, ...]; instruct: JSONL records of a prompt and a response; chat "
                   "and instruct are rendered with the tokenizer's chat template (default: text)")
    p.add_argument("--messages-key", default="messages", metavar="KEY", help="--format chat: the key of a record's "
                   "messages (default: messages)")
    p.add_argument("--prompt-key", default="prompt", metavar="KEY", help="--format instruct: the prompt's key "
                   "(default: prompt)")
    p.add_argument("--response-key", default="response", metavar="KEY", help="--format instruct: the response's "
                   "key (default: response)")
    p.add_argument("--system-key", default=None, metavar="KEY", help="--format instruct: a system message's key, "
                   "when records have one (default: none)")
    p.add_argument("--train-on", default="assistant", choices=TRAIN_ON, help="chat and instruct: the tokens that "
                   "are targets: the assistant turns' (the rest get -100) or all (default: assistant)")
    p.add_argument("--max-seq-len", type=int, default=None, metavar="N", help="records of more tokens are counted "
                   "and dropped or truncated (--too-long); for --pack, the training's --seq-len (default: no limit)")
    p.add_argument("--too-long", default="drop", choices=TOO_LONG, help="what happens to a record longer than "
                   "--max-seq-len (default: drop)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, metavar="N", help="tokens per shard (default: 100M)")
    p.add_argument("--val-fraction", type=float, default=0.01, metavar="F",
                   help="the share of documents in the validation split, in (0, 1) (default: 0.01)")
    p.add_argument("--workers", type=int, default=None, metavar="N", help="encoding processes (default: the cores)")
    p.add_argument("--overwrite", action="store_true", help="replace a preparation in --out")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:  # (no MPI here: cutp.runtime.failure's handler would start it, and the workers fork)
        prepare(args.inputs, args.tokenizer, args.out, text_key=args.text_key, shard_tokens=args.shard_tokens,
                val_fraction=args.val_fraction, workers=args.workers, overwrite=args.overwrite,
                records=RecordSettings(args.format, args.messages_key, args.prompt_key, args.response_key,
                                       args.system_key, args.train_on, args.max_seq_len, args.too_long))
    except UserError as e:  # its settings named as this command's flags
        print(f"prepare-data: error: {e.render(lambda name: '--' + name.replace('_', '-'))}", file=sys.stderr)
        return e.exit_status
    return 0


# ---- inputs (cutp.data.records reads them) -------------------------------------------------------
def is_val(i: int, fraction: float) -> bool:
    return math.ceil((i + 1) * fraction) > math.ceil(i * fraction)


# ---- encoding (in the workers) -------------------------------------------------------------------
_WORKER = {}


def _init_worker(spec, dtype: str, rs: RecordSettings = RecordSettings(), template: tuple | None = None) -> None:
    """spec: the --tokenizer argument (a worker process), or the tokenizer loaded (one worker:
    this process); template: the chat template's (source, variables) for chat records."""
    if isinstance(spec, str):  # a worker: one thread (before its first encode), --workers says how many
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = load_tokenizer(spec) if isinstance(spec, str) else spec
    if not isinstance(tok, ByteTokenizer):
        # a document's "<|endoftext|>" is text; a chat template's special tokens are tokens (transformers')
        tok.tokenizer.encode_special_tokens = not rs.chat
    _WORKER.update(tok=tok, dtype=np.dtype(dtype), rs=rs,
                   template=ChatTemplate(*template) if template is not None else None)


def _encode(batch: list) -> tuple:
    """(all kept records' tokens, one after the other; each record's length; their target masks
    one after the other (chat records) or None; which records were dropped; the counts of
    dropped and truncated records). batch: [(record, where)]."""
    tok, dtype, rs = _WORKER["tok"], _WORKER["dtype"], _WORKER["rs"]
    counts = dict.fromkeys(("no_target", "too_long", "truncated"), 0)
    if rs.chat:
        ids, masks = [], []
        for record, where in batch:
            try:
                i, m = encode_chat(tok, _WORKER["template"], record.messages, rs.train_on, tools=record.tools,
                                   documents=record.documents)
            except ChatError as e:
                raise ConfigError(f"{where}: {e}") from None
            ids.append(i)
            masks.append(m)
    else:
        ids, masks = tok.encode_batch([text for text, _ in batch]), None
        eos = tok.eos_id
        if eos is not None:
            for d in ids:
                if not d or d[-1] != eos:  # (a template may end a document with EOS already)
                    d.append(eos)
    dropped = np.zeros(len(ids), bool)
    for k, d in enumerate(ids):
        if rs.max_seq_len is not None and len(d) > rs.max_seq_len:
            counts["too_long"] += 1
            if rs.too_long == "drop":
                dropped[k] = True
                continue
            counts["truncated"] += 1
            ids[k] = d[:rs.max_seq_len]
            if masks is not None:
                masks[k] = masks[k][:rs.max_seq_len]
        if masks is not None and not masks[k].any():
            counts["no_target"] += 1
            dropped[k] = True
    kept = [d for d, x in zip(ids, dropped) if not x]
    lengths = np.fromiter(map(len, kept), np.int64, len(kept))
    flat = np.fromiter(itertools.chain.from_iterable(kept), dtype, int(lengths.sum()))
    mask = None if masks is None else (np.concatenate([m for m, x in zip(masks, dropped) if not x])
                                       if len(kept) else np.zeros(0, np.uint8))
    return flat, lengths, mask, dropped, counts


# ---- the run -------------------------------------------------------------------------------------
def prepare(inputs: list, tokenizer: str, out: str, *, text_key: str = "text", shard_tokens: int = 100_000_000,
            val_fraction: float = 0.01, workers: int | None = None, overwrite: bool = False,
            batch_bytes: int = BATCH_BYTES, after_shard=None, stream=None,
            records: RecordSettings | None = None) -> dict:
    """Writes the shards and meta.json of `inputs` into `out`; returns the meta dict (see the
    module's docstring). `batch_bytes`: text per worker task (and so how often progress can be
    recorded); `after_shard(name)` runs after each shard is renamed into place, before
    progress.json records it (a test's kill point); `stream` gets the progress (default stderr)."""
    stream = sys.stderr if stream is None else stream
    rs = records or RecordSettings()
    rs.check()
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ConfigError(f"`shard_tokens` must be an integer >= 1, got {shard_tokens!r}")
    if not 0 < val_fraction < 1:
        raise ConfigError(f"`val_fraction` must be in (0, 1) (the validation split's share of documents), "
                          f"got {val_fraction}")
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise ConfigError(f"`workers` must be >= 1, got {workers}")
    files = input_files(inputs, exclude=out)
    tok = load_tokenizer(tokenizer)
    template = None
    if rs.chat:
        if tokenizer == BYTES:
            raise ConfigError(f"--format {rs.format} renders records with a tokenizer's chat template; give a "
                              "tokenizer directory with one, not 'bytes'")
        chat = ChatTemplate.from_dir(tokenizer if os.path.isdir(tokenizer) else os.path.dirname(tokenizer))
        template = (chat.source, chat.variables)
    identity = tok.identity()
    if tokenizer != BYTES:
        identity["path"] = os.path.abspath(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    stats = [os.stat(f) for f in files]
    listing = json.dumps([[f, st.st_size, st.st_mtime_ns] for f, st in zip(files, stats)]).encode()
    settings = {"format": FORMAT, "version": FORMAT_VERSION, "tokenizer": identity, "dtype": dtype.name,
                "text_key": text_key, "shard_tokens": shard_tokens, "val_fraction": val_fraction,
                "inputs": [os.path.abspath(p) for p in inputs], "files": len(files),
                "bytes": sum(st.st_size for st in stats), "records": asdict(rs)}
    if template is not None:
        settings["chat_template_sha256"] = hashlib.sha256(template[0].encode()).hexdigest()
    # a rerun resumes only over the same files, unchanged (names, sizes, modification times)
    resume_key = {**settings, "files_sha256": hashlib.sha256(listing).hexdigest()}
    existed = os.path.exists(out)
    claimed = _claim_out(out, resume_key, overwrite)
    with _removed_on_input_error(out, fresh=claimed is None, created=not existed):
        state = claimed or {
            "next_doc": 0, "documents": {s: 0 for s in SPLITS}, "splits": {s: None for s in SPLITS},
            "masks": {s: None for s in SPLITS}, "docs": {s: None for s in SPLITS},
            "counts": dict.fromkeys(("no_target", "too_long", "truncated"), 0)}
        writers = {s: ShardWriter(out, s, dtype, shard_tokens, state["splits"][s]) for s in SPLITS}
        # beside the tokens: each document's length, and each token's target flag (chat records)
        lengths_out = {s: ShardWriter(out, s, dtype, shard_tokens, state["docs"][s], ext=DOCS_EXT) for s in SPLITS}
        masks_out = {s: ShardWriter(out, s, dtype, shard_tokens, state["masks"][s], ext=MASK_EXT) for s in SPLITS} \
            if rs.chat else {}
        side = [*lengths_out.values(), *masks_out.values()]
        documents_in, counts = dict(state["documents"]), dict(state["counts"])
        start_doc = next_doc = state["next_doc"]
        progress = _Progress(stream, settings["bytes"], workers)

        def save():
            for w in [*writers.values(), *side]:
                w.sync()
            _write_json(os.path.join(out, PROGRESS_FILE), {
                "settings": resume_key, "next_doc": next_doc, "documents": documents_in, "counts": counts,
                "splits": {n: w.state() for n, w in writers.items()},
                "docs": {n: w.state() for n, w in lengths_out.items()},
                "masks": {n: (masks_out[n].state() if masks_out else None) for n in SPLITS}})

        save()  # from here on, a rerun of the same command resumes
        saved = time.perf_counter()
        batches = _batches(records_of(files, rs, text_key), start_doc, batch_bytes, progress)
        encoded = _encoded(batches, tokenizer, tok, dtype, workers, rs, template)
        for first, (flat, lengths, mask, dropped, found), nbytes in encoded:
            finished, start, kept = [], 0, iter(lengths)
            for k in range(len(dropped)):
                if dropped[k]:
                    continue
                n = next(kept)
                split = "val" if is_val(first + k, val_fraction) else "train"
                finished += writers[split].write(flat[start:start + n])
                lengths_out[split].write(np.array([n], np.uint32))
                if masks_out:
                    masks_out[split].write(mask[start:start + n])
                documents_in[split] += 1
                start += n
            for key, v in found.items():
                counts[key] += v
            next_doc = first + len(dropped)
            for name in finished:
                if after_shard is not None:
                    after_shard(name)
            if finished or time.perf_counter() - saved > PROGRESS_SECONDS:
                save()
                saved = time.perf_counter()
            progress.done(nbytes, len(flat))
        for w in side:
            w.close()
        for name in [n for w in writers.values() for n in w.close()]:
            if after_shard is not None:
                after_shard(name)
        if documents_in["train"] == 0:
            dropped = counts["no_target"] + counts["too_long"] - counts["truncated"]
            raise ConfigError(f"the train split has no documents ({next_doc} in all, the first going to validation"
                              + (f"; {dropped} dropped: {counts['no_target']} without a target token"
                                 + (" (truncated ones included)" if counts["truncated"] else "")
                                 + f", {counts['too_long'] - counts['truncated']} longer than `max_seq_len`"
                                 if dropped else "")
                              + "); give more documents (a text file is one document)")
        meta = {**settings, "vocab_size": tok.vocab_size, "documents": sum(documents_in.values()),
                "tokens": sum(w.tokens for w in writers.values()),
                "splits": {n: {"documents": documents_in[n], "tokens": w.tokens, "shards": w.shards,
                               "docs": lengths_out[n].shards, **({"masks": masks_out[n].shards} if masks_out else {})}
                           for n, w in writers.items()}, "dropped": counts}
        _write_json(os.path.join(out, META_FILE), meta)
        os.remove(os.path.join(out, PROGRESS_FILE))
        progress.summary(meta, out)
        return meta


def _batches(found, start_doc: int, batch_bytes: int, progress):
    """(index of the first record, [(record, where)], bytes) of about batch_bytes of input at a
    time, from record start_doc on (those before it are read, not encoded: a resumed run has them)."""
    batch, size, first = [], 0, start_doc
    for i, (record, nbytes, where) in enumerate(found):
        if i < start_doc:
            progress.skipped(nbytes)
            continue
        batch.append((record, where))
        size += nbytes
        if size >= batch_bytes:
            yield first, batch, size
            batch, size, first = [], 0, i + 1
    if batch:
        yield first, batch, size


def _encoded(batches, spec: str, tok, dtype: np.dtype, workers: int, rs: RecordSettings, template):
    """(first record, _encode(batch), bytes) per batch, in order; at most 2 x workers batches in flight."""
    if workers == 1:
        _init_worker(tok, dtype.name, rs, template)
        for first, texts, nbytes in batches:
            yield first, _encode(texts), nbytes
        return
    # Not "fork": a process that has used threads (the tokenizers library's own pool, BLAS, a host
    # program's) can leave a lock held in the child, which then waits forever (seen in the test
    # suite). The fork server is a clean single-threaded process the workers fork from.
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    pool = ctx.Pool(workers, _init_worker, (spec, dtype.name, rs, template))
    try:
        flight = collections.deque()
        for first, texts, nbytes in batches:
            flight.append((first, pool.apply_async(_encode, (texts,)), nbytes))
            if len(flight) >= 2 * workers:
                f, r, b = flight.popleft()
                yield f, r.get(), b
        while flight:
            f, r, b = flight.popleft()
            yield f, r.get(), b
    finally:
        # close and join, not terminate (the pool's `with`): the tasks in flight (at most 2 x workers
        # batches) finish; workers killed mid-task could leave the pool's task thread blocked for ever
        # on a pipe full of a large batch nobody reads any more (a hang seen when a run stops early)
        pool.close()
        pool.join()


# ---- the output directory ------------------------------------------------------------------------
def _ours(name: str) -> bool:
    return name in (META_FILE, PROGRESS_FILE, META_FILE + ".tmp", PROGRESS_FILE + ".tmp") or any(
        name.startswith(s + "_") and any(name.endswith(e) or name.endswith(e + ".tmp") for e in (".bin", MASK_EXT,
                                                                                                 DOCS_EXT))
        for s in SPLITS)


@contextlib.contextmanager
def _removed_on_input_error(out: str, fresh: bool, created: bool):
    """A preparation started afresh that stops on its inputs (a UserError: no documents for the
    train split, a record without its text key) leaves no half-made `out`: its progress.json would
    make the corrected command refuse to start, and `--data` call it unfinished. An interruption
    (Ctrl-C, a kill) keeps it, to be resumed; so does a resumed preparation."""
    try:
        yield
    except UserError:
        if fresh:
            for name in os.listdir(out):
                if _ours(name):
                    os.remove(os.path.join(out, name))
            if created and not os.listdir(out):
                os.rmdir(out)
        raise


def _claim_out(out: str, settings: dict, overwrite: bool) -> dict | None:
    """The progress to resume from (None: start afresh), after the checks on `out`."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"`out` {out} is a file, not a directory; choose a new or empty directory")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"`out` {out} cannot be created ({e.strerror}); choose a writable directory") from None
    names = os.listdir(out)
    others = [n for n in names if not _ours(n)]
    if others:
        raise ConfigError(f"`out` {out} holds files prepare-data did not write ({others[0]}, ...); choose a new or "
                          "empty directory")
    if os.path.isfile(os.path.join(out, PROGRESS_FILE)) and not overwrite:
        try:
            with open(os.path.join(out, PROGRESS_FILE), encoding="utf-8") as f:
                progress = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"`out` {out}: {PROGRESS_FILE} is unreadable ({e}); add `overwrite` to start again") from None
        if not isinstance(progress, dict) or progress.get("settings") != settings:
            raise ConfigError(f"`out` {out} holds an unfinished preparation with other inputs or settings; "
                              "run that command again to finish it, or add `overwrite` to start this one")
        return progress
    if META_FILE in names and not overwrite:
        raise ConfigError(f"`out` {out} already holds prepared data ({META_FILE}); choose another `out` or add "
                          "`overwrite` to replace it")
    for n in names:  # --overwrite, or leftovers of a run killed before its first progress record
        os.remove(os.path.join(out, n))
    return None


def _write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


class _Progress:
    """A progress line (tokens/s, ETA) redrawn on a terminal; a summary line at the end."""

    def __init__(self, stream, total_bytes: int, workers: int):
        self.stream, self.total, self.workers = stream, max(total_bytes, 1), workers
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.start, self.last = time.perf_counter(), 0.0  # (drawn at the first batch)
        self.bytes = self.skipped_bytes = self.tokens = 0

    def skipped(self, nbytes: int) -> None:
        self.skipped_bytes += nbytes

    def done(self, nbytes: int, ntokens: int) -> None:
        self.bytes += nbytes
        self.tokens += ntokens
        now = time.perf_counter()
        if self.tty and now - self.last > 0.2:
            self.last = now
            rate = self.bytes / max(now - self.start, 1e-9)
            left = (self.total - self.skipped_bytes - self.bytes) / max(rate, 1e-9)
            self.stream.write(f"\rprepare-data: {(self.skipped_bytes + self.bytes) / 1e6:,.1f} of "
                              f"{self.total / 1e6:,.1f} MB, {self.tokens:,} tokens, "
                              f"{self.tokens / (now - self.start):,.0f} tokens/s, ETA {left:,.0f} s   ")
            self.stream.flush()

    def summary(self, meta: dict, out: str) -> None:
        secs = time.perf_counter() - self.start
        sp = meta["splits"]
        resumed = f" (resumed: {self.skipped_bytes / 1e6:,.1f} MB skipped)" if self.skipped_bytes else ""
        self.stream.write(("\n" if self.tty else "") +
                          f"prepare-data: {meta['tokens']:,} {meta['dtype']} tokens of {meta['documents']:,} documents "
                          f"(train {sp['train']['tokens']:,} in {len(sp['train']['shards'])} shard(s), val "
                          f"{sp['val']['tokens']:,} in {len(sp['val']['shards'])}) from {self.bytes / 1e6:,.1f} MB in "
                          f"{secs:.1f} s: {self.tokens / max(secs, 1e-9):,.0f} tokens/s with {self.workers} "
                          f"worker(s){resumed} -> {out}\n")
        dropped, limit = meta["dropped"], meta["records"]["max_seq_len"]
        if dropped["no_target"] or dropped["too_long"]:
            self.stream.write(f"prepare-data: {dropped['no_target']:,} record(s) with no target token dropped"
                              + (" (truncated ones included)" if dropped["truncated"] else "") + "; "
                              f"{dropped['too_long']:,} longer than --max-seq-len {limit} "
                              f"({dropped['truncated']:,} truncated, {dropped['too_long'] - dropped['truncated']:,} "
                              "dropped)\n")
        if not sp["val"]["documents"]:  # (a warning: a run with --eval-every 0 trains on it as it is)
            self.stream.write("prepare-data: warning: the val split is empty: every record chosen for validation was "
                              "dropped; train on this data with --eval-every 0 (no validation), or prepare it again "
                              "with a larger --max-seq-len or --val-fraction\n")
        self.stream.flush()
