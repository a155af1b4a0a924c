"""Dropout RNG streams: shared inside replicated regions, distinct inside sharded ones.

Masks come from a counter-based generator (`cutp.ops.dropout_mask(xp, shape, p, seed, offset)`),
so a stream is just (seed, offset): drawing n numbers returns the current offset and advances it
by n. That makes the state two integers per stream, trivially saved in a checkpoint's JSON, and
the masks are bit-identical on NumPy, CuPy and in our CUDA kernel.

- "replicated": same seed on every rank of a TP group (activations there are identical, so
  the masks must be too); folded with the DP rank, since DP ranks see different data.
- "sharded": a different seed per TP rank (attention probabilities are split by heads), as
  Megatron's model-parallel stream (seed + 2718 + tp_rank).

Those streams depend on the layout. Training draws by position instead (`set_position`, which
`cutp.train.train_step` calls before each micro-batch): a dropout site named `site` uses the
seed `site_seed(site)` and, for the element at global batch row R (of the step's global batch
of B sequences), global element e of that row's E (all heads, all features), the counter
(step * B + R) * E + e. So a mask is a pure function of (seed, site, step, global token, global
feature): TP, DP, micro-batching and recomputation all give the same masks.
"""
from __future__ import annotations

import hashlib

REPLICATED = "replicated"
SHARDED = "sharded"


def _mix(*parts) -> int:
    """A 63-bit seed from the parts (stable across runs and machines, unlike hash())."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class RNGTracker:
    def __init__(self, seed: int, tp_rank: int = 0, dp_rank: int = 0):
        self.seed = int(seed)
        self.seeds = {
            REPLICATED: _mix(seed, "replicated", dp_rank),
            SHARDED: _mix(seed, 2718, "sharded", dp_rank, tp_rank),
        }
        self.offsets = {REPLICATED: 0, SHARDED: 0}
        self.position: tuple[int, int, int] | None = None  # (step, first global row, global batch)

    def set_position(self, step: int, first_row: int, batch: int) -> None:
        """The micro-batch about to run: optimizer step `step`, its first sequence's row in the
        step's global batch of `batch` sequences. Dropout sites with a name then draw by position."""
        self.position = (int(step), int(first_row), int(batch))

    def site_seed(self, site: str) -> int:
        return _mix(self.seed, "site", site)

    def draw(self, stream: str, n: int) -> tuple[int, int]:
        """(seed, offset) for n random numbers from `stream`; advances the stream."""
        off = self.offsets[stream]
        self.offsets[stream] = off + int(n)
        return self.seeds[stream], off

    def state_dict(self) -> dict:
        """The same on every rank (the per-rank seeds follow from the base seed and the mesh), so a
        checkpoint stores it once and a run resumed on another mesh can restore it."""
        return {"seed": self.seed, "offsets": dict(self.offsets)}

    def load_state_dict(self, state: dict) -> None:
        if set(state.get("offsets", {})) != set(self.offsets):
            raise ValueError(f"RNG state has streams {sorted(state.get('offsets', {}))}, expected {sorted(self.offsets)}")
        if int(state.get("seed", self.seed)) != self.seed:
            raise ValueError(f"RNG state was saved with seed {state['seed']}, this tracker has seed {self.seed}")
        self.offsets = {k: int(v) for k, v in state["offsets"].items()}
