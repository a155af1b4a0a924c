"""kernels/README.md's resource table: per kernel, registers (sm_80, sm_90) against its budget,
spills, static and dynamic shared memory, theoretical occupancy on H100, bytes moved per element
and the roofline bound on H100 and H200.

    python tools/kernel_resources.py            # prints the Markdown table (compiles with nvcc)
    python tools/kernel_resources.py --write    # replaces it in kernels/README.md

Registers, spills and static shared memory are ptxas's (``cutp.kernels.resources``, which
compiles what NVRTC compiles); the block size and occupancy target are ``resources.TARGETS``;
bytes and operations per element are ``TRAFFIC``, each family's declared model (kernels/<op>.py FAMILY).
tests/kernel_build/test_resources.py checks that the README holds exactly what this prints.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cutp.kernels import resources as kr  # noqa: E402  (after the path set-up above)
from cutp.kernels.family import Traffic, families  # noqa: E402

BEGIN = "<!-- kernel_resources.py: begin -->"
END = "<!-- kernel_resources.py: end -->"

# Roofline of the devices (dense, non-tensor-core; NVIDIA's data sheets, SXM parts).
HBM_TBS = {"H100": 3.35, "H200": 4.8}  # TB/s
FP32_TFLOPS = 67.0  # H100 and H200 (same GH100 chip, same clocks)
INT32_TOPS = 16.7  # 64 INT32 lanes per SM x 132 SMs x 1.98 GHz (a 64-bit multiply is several ops)


# Global-memory traffic and arithmetic per element, as each family declares it (kernels/<op>.py
# FAMILY.traffic, counted from its source); the compute-bound kernels (the fused attention's
# tiles: their bound is TFLOP/s, measured by `cutp bench kernels --ops attention`) have none.
TRAFFIC: dict[str, Traffic] = {k: t for f in families() for k, t in f.traffic.items()}
COMPUTE_BOUND = {k for f in families() for k in f.compute_bound}


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
