"""Checkpoints: safetensors shards plus JSON metadata; atomic, checksummed, reshardable.

Layout of a run directory (`--out DIR`):

    DIR/step-00000100/meta.json                     config, step, mesh, data position, RNG
                                                    offsets, optimizer hyperparameters, a
                                                    sha256 per file, each parameter's sharding
    DIR/step-00000100/model-tp00-of-02.safetensors  TP rank 0's parameter shards
    DIR/step-00000100/optim-tp00-of-02.safetensors  its AdamW moments (exp_avg., exp_avg_sq.) and,
                                                    for 16-bit models, fp32 master weights (master.)
    .../optim-tp00-of-02-dp01-of-04.safetensors     or, with the distributed optimizer, DP rank 1's
                                                    shard of them: the flat pieces [a, b) of each
                                                    parameter it owns, offsets in the file's metadata
    DIR/latest                                      JSON naming the newest complete checkpoint

Pipeline runs (pp > 1) name each stage's files: model-pp01-of-02-tp00-of-02.safetensors,
optim-pp01-of-02-tp00-of-02[-dp01-of-04].safetensors; meta.json's mesh adds pp and pp_layers,
each parameter its "stage" (the stage whose files hold it) and rng.stages each stage's RNG
stream offsets (dropout by position leaves them at 0; a draw without a position advances them).
The last stage's copy of a tied token embedding (bit-identical to the first stage's, and so is
its optimizer state) is written once, by the first stage, and loaded from there. At pp 1 names
and meta.json are as before pipelines. Loading reads each parameter from its
stage's files, so a checkpoint loads at any PP size and stage layout as at any TP size.

A checkpoint is written into `DIR/.tmp-step-...` and renamed when complete, so a crash during a
save leaves the previous checkpoint intact; older ones are removed only after a newer one is
complete (`keep`; cutp.checkpoint.run_dir: listing, `latest`, pruning, the run directory's lock). Weights
or optimizer state with a NaN or Inf are never saved. meta.json is sealed by its own sha256 and
every field of it is checked before use (cutp.checkpoint.files). Loading verifies every needed
file's size, sha256 and tensor shapes before reading any tensor, on every rank, and all ranks
agree before anything is loaded. Loading at another TP
size reassembles each full tensor from the saved shards (one tensor at a time) and keeps this
rank's slice. The optimizer state is saved by parameter: whole (plain optimizer) or as the DP
shards' pieces of each parameter (distributed optimizer: every DP rank writes its own file,
nothing is gathered), which loading puts back together one tensor at a time, keeping only what
this rank's optimizer owns. So a checkpoint resumes at any TP and DP size, with or without the
distributed optimizer. Only safetensors and JSON are read: loading never executes code.

`python -m cutp.checkpoint export SRC DST [--dtype D]` writes a single-shard (TP=1, PP=1) copy of a
checkpoint, its parameters in the precision asked for (from the fp32 master weights when saved).

The package: `save` (save_checkpoint), `load` (load_checkpoint, load_model, read_shard; load_weights:
a run's `init_from`, read per parameter into ZeRO-3's deferred parameters),
`export` (export_full and the command line), `files` (names, checksums, meta.json and the checks
of every field), `run_dir` (listing, `latest`, pruning, the lock), `experts` (expert-parallel
shards gathered for a save).
"""
from .export import export_full, main
from .files import CheckpointError, is_cutp_checkpoint, read_meta, sha256_file, verify_file
from .load import (ARCH_FIELDS, check_config_matches, load_checkpoint, load_model, load_weights, read_shard,
                   verify_checkpoint)
from .run_dir import list_checkpoints, lock_run_dir, prepare_run_dir, prune_checkpoints, resolve_checkpoint
from .save import checkpoint_name, save_checkpoint

__all__ = ["ARCH_FIELDS", "CheckpointError", "check_config_matches", "checkpoint_name", "export_full",
           "is_cutp_checkpoint", "list_checkpoints", "load_checkpoint", "load_model", "load_weights", "lock_run_dir", "main",
           "prepare_run_dir", "prune_checkpoints", "read_meta", "read_shard", "resolve_checkpoint",
           "save_checkpoint", "sha256_file", "verify_checkpoint", "verify_file"]
