"""kernels/README.md's resource table: per kernel, registers (sm_80, sm_90) against its budget,
spills, static and dynamic shared memory, theoretical occupancy on H100, bytes moved per element
and the roofline bound on H100 and H200.

    python tools/kernel_resources.py            # prints the Markdown table (compiles with nvcc)
    python tools/kernel_resources.py --write    # replaces it in kernels/README.md

Registers, spills and static shared memory are ptxas's (``cutp.kernels.resources``, which
compiles what NVRTC compiles); the block size and occupancy target are ``resources.TARGETS``;
bytes and operations per element are the model in ``TRAFFIC`` below, counted from the sources.
tests/kernel_build/test_resources.py checks that the README holds exactly what this prints.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cutp.kernels import resources as kr  # noqa: E402  (after the path set-up above)

BEGIN = "<!-- kernel_resources.py: begin -->"
END = "<!-- kernel_resources.py: end -->"

# Roofline of the devices (dense, non-tensor-core; NVIDIA's data sheets, SXM parts).
HBM_TBS = {"H100": 3.35, "H200": 4.8}  # TB/s
FP32_TFLOPS = 67.0  # H100 and H200 (same GH100 chip, same clocks)
INT32_TOPS = 16.7  # 64 INT32 lanes per SM x 132 SMs x 1.98 GHz (a 64-bit multiply is several ops)


@dataclass(frozen=True)
class Traffic:
    """Global-memory traffic and arithmetic per element of the kernel's main tensor.

    t: accesses of storage-type (T) elements (a re-read of the row by a later pass counts again);
    f32: accesses of float32 elements; u8: accesses of one-byte elements (masks);
    ops: arithmetic per element (a special function counted as ~8), int: ops are integer.
    Per-row and per-column vectors (weights, statistics, partial sums) are left out: they are
    amortised over the rows."""

    t: int
    f32: int = 0
    u8: int = 0
    ops: int = 1
    int: bool = False
    what: str = ""

    def bytes_per_element(self, itemsize: int) -> int:
        return self.t * itemsize + 4 * self.f32 + self.u8


TRAFFIC: dict[str, Traffic] = {
    "gelu_forward": Traffic(2, ops=20, what="read x, write y"),
    "gelu_backward": Traffic(3, ops=30, what="read x, dy; write dx"),
    "bias_gelu_forward": Traffic(3, ops=21, what="read x; write pre, y"),
    "bias_gelu_backward": Traffic(3, ops=31, what="read pre, dy; write dx"),
    "column_sum": Traffic(0, f32=1, ops=1, what="read a partial"),
    "softmax_forward": Traffic(3, ops=12, what="read x twice (2 passes), write y"),
    "softmax_backward": Traffic(5, ops=5, what="read dy, y twice (2 passes), write dx"),
    "layernorm_forward": Traffic(4, ops=8, what="read x 3 times (3 passes), write y"),
    "layernorm_backward": Traffic(5, ops=20, what="read dy, x twice (2 passes), write dx"),
    "rmsnorm_forward": Traffic(3, ops=5, what="read x twice (2 passes), write y"),
    "residual_rmsnorm_forward": Traffic(5, ops=6, what="read x, branch; write s; read s; write y"),
    "rmsnorm_backward": Traffic(5, ops=12, what="read dy, x twice (2 passes), write dx"),
    "swiglu_forward": Traffic(3, ops=12, what="read gate, up; write y (per output element)"),
    "swiglu_backward": Traffic(5, ops=18, what="read gate, up, dy; write d_gate, d_up (per output element)"),
    "rotary": Traffic(2, f32=2, ops=3, what="read x, cos, sin; write y (per element)"),
    "ce_shard_forward": Traffic(1, ops=14, what="read a logit once (online max and sum of exp, sum, target)"),
    "ce_shard_backward": Traffic(2, ops=14, what="read a logit, write its gradient"),
    "adamw_update": Traffic(3, f32=4, ops=16, what="read p, g, m, v; write p, m, v (no decay mask)"),
    "dropout_mask_bool": Traffic(0, u8=1, ops=28, int=True, what="write the mask (SplitMix64)"),
    "dropout_forward": Traffic(2, u8=1, ops=30, int=True, what="read x; write y, mask"),
    "dropout_apply": Traffic(2, u8=1, ops=2, what="read x, mask; write y"),
    "attention_backward_rowdot_d64": Traffic(2, ops=2, what="read o, do; a float per row"),
    "attention_backward_rowdot_d128": Traffic(2, ops=2, what="read o, do; a float per row"),
}

# The fused attention's tile kernels are compute-bound (4 T^2 D / 2 multiply-adds per head against
# O(T D) bytes): their bound is TFLOP/s, measured by `cutp bench kernels --ops attention`.
COMPUTE_BOUND = {f"attention_{kernel}_d{d}" for kernel in ("forward", "backward_dq", "backward_dkdv") for d in (64, 128)}


def _itemsize(kernel: str) -> int:
    return 2 if kernel.endswith("_bf16") else 4


def bound(kernel: str, device: str) -> str:
    """'memory, N Gelem/s' or 'compute, N Gelem/s': the roofline's lower of the two."""
    tr = TRAFFIC[kr.family(kernel)]
    mem = HBM_TBS[device] * 1e12 / tr.bytes_per_element(_itemsize(kernel))
    comp = (INT32_TOPS if tr.int else FP32_TFLOPS) * 1e12 / tr.ops
    kind, rate = ("memory", mem) if mem <= comp else ("int compute" if tr.int else "compute", comp)
    return f"{kind}, {rate / 1e9:,.0f}"


def rows(res: dict) -> list[list[str]]:
    out = []
    kernels = sorted({k for k, _ in res})
    for k in kernels:
        fam = kr.family(k)
        t = kr.TARGETS[fam]
        r80, r90 = res[(k, "sm_80")], res[(k, "sm_90")]
        dyn = kr.DYNAMIC_SHARED.get(fam)
        dyn_typ = dyn.bytes_of(dyn.typical_c) if dyn else 0
        occ = kr.occupancy("sm_90", t.threads, r90.registers, r90.static_smem + dyn_typ)
        blocks = kr.blocks_per_sm("sm_90", t.threads, r90.registers, r90.static_smem + dyn_typ)
        occ_txt = f"{occ:.0%} ({blocks} x {t.threads})"
        spills = r80.spill_stores + r80.spill_loads + r90.spill_stores + r90.spill_loads
        budget = {kr.register_budget(a, t) for a in kr.ARCHS}
        out.append([
            f"`{k}`",
            f"{r80.registers} / {r90.registers}",
            f"{'/'.join(map(str, sorted(budget)))} ({t.blocks_per_sm} x {t.threads})",
            str(spills),
            f"{max(r80.static_smem, r90.static_smem)} B",
            f"`{dyn.formula}`" if dyn else "0",
            occ_txt,
            *((str(TRAFFIC[fam].bytes_per_element(_itemsize(k))), bound(k, "H100"), bound(k, "H200"))
              if fam not in COMPUTE_BOUND else ("-", "compute (TFLOP/s)", "compute (TFLOP/s)")),
        ])
    return out


HEADER = ["kernel", "registers sm_80 / sm_90", "budget (blocks x threads)", "spill bytes", "static smem",
          "dynamic smem", "H100 occupancy (blocks x threads)", "bytes / element", "H100 bound, Gelem/s",
          "H200 bound, Gelem/s"]


def markdown(res: dict, release: str) -> str:
    """The README's table (between BEGIN and END), with its notes; `release`: nvcc's
    (resources.nvcc_release())."""
    lines = [BEGIN, "", f"ptxas of nvcc {release}:", "", "| " + " | ".join(HEADER) + " |",
             "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(res)]
    lines.append("")
    for fam, dyn in kr.DYNAMIC_SHARED.items():
        entries = sorted({k for k, _ in res if kr.family(k) == fam})
        t = kr.TARGETS[fam]
        for c in sorted({6144, dyn.biggest_c} if dyn.width == "C" else {dyn.biggest_c}):
            for arch in kr.ARCHS:
                static = max(res[(k, arch)].static_smem for k in entries)
                regs = max(res[(k, arch)].registers for k in entries)
                smem = static + dyn.bytes_of(c)
                at = f"C={c}" if dyn.width == "C" else f"head dim {c}"
                lines.append(f"* `{fam}` at {at} on {arch}: {smem:,} B of shared memory per block ({static} static), "
                             f"over the 48 KiB default, so the launcher opts in (limit "
                             f"{kr.LIMITS[arch].smem_per_block_opt_in:,} B); "
                             f"{kr.blocks_per_sm(arch, t.threads, regs, smem)} block(s) of {t.threads} per SM."
                             if smem > kr.DEFAULT_SHARED_LIMIT else
                             f"* `{fam}` at {at} on {arch}: {smem:,} B of shared memory per block, within 48 KiB.")
    lines += ["", END]
    return "\n".join(lines)


README = Path(__file__).resolve().parent.parent / "kernels" / "README.md"


def replace_table(readme: str, table: str) -> str:
    """`readme` with the text from BEGIN to END replaced by `table`."""
    i, j = readme.index(BEGIN), readme.index(END) + len(END)
    return readme[:i] + table + readme[j:]


def main(argv=None) -> int:
    write = "--write" in (sys.argv[1:] if argv is None else argv)
    table = markdown(kr.compile_all(), kr.nvcc_release())
    if write:
        README.write_text(replace_table(README.read_text(), table))
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
