"""Index arithmetic of kernels/*.cu is 64-bit wherever it can pass 2^31 (kernels/README.md,
convention 3): a source-level audit, since no emulated test can allocate arrays of 2^31 elements.

Every integer product, initialisation and cast in the kernel sources is typed from the
declarations before it (parameters, locals, struct members, CUDA's built-in indices) and:

* a product of two 32-bit integers fails unless one factor is a compile-time constant (``P``,
  ``WARP_SIZE``, a literal, a template parameter) or both are bounded by the block size (``threadIdx``, ``blockDim``):
  ``row * W`` with an ``int`` row, ``blockIdx.x * blockDim.x``, ``(int)k * C`` all fail;
* a 32-bit variable initialised from an expression holding a 64-bit value fails (silent
  narrowing: ``const int off = g.row * Tk``);
* an explicit cast of a 64-bit expression to a 32-bit type fails unless it is in ``NARROWING_OK``
  with the reason the value is bounded;
* element counts and row counts (``n``, ``n_rows``) are ``long long`` parameters.

The checker itself is tested on planted snippets, each of which must be reported.
"""
from __future__ import annotations

import pathlib
import re

import pytest

KERNELS_DIR = pathlib.Path(__file__).resolve().parents[2] / "kernels"
SOURCES = sorted(p.name for p in KERNELS_DIR.glob("*.cu"))

T64 = "64"      # long long, unsigned long long, size_t
T32 = "32"      # int, unsigned, blockIdx, gridDim, and casts to them
SMALL = "small"  # threadIdx, blockDim: at most 1024
CONST = "const"  # literals, constexpr names
FLOAT = "float"
PTR = "ptr"
UNKNOWN = "?"

_BUILTINS = {"threadIdx": SMALL, "blockDim": SMALL, "blockIdx": T32, "gridDim": T32}
_TYPE_WORDS = {
    "unsigned long long": T64, "long long": T64, "size_t": T64, "unsigned int": T32, "unsigned": T32, "int": T32,
    "float": FLOAT, "double": FLOAT, "bool": T32,
}
_KEYWORDS = {"return", "const", "T", "float", "int", "void", "char", "bool", "int4", "unsigned", "long", "auto",
             "__nv_bfloat16", "double", "size_t", "case", "else", "do"}
_TYPE_RE = r"(unsigned long long|long long|unsigned int|unsigned|int|size_t|float|double|bool)"
# Explicit casts of 64-bit values to 32 bits that are bounded by construction: (file, text, why).
NARROWING_OK = [
    ("softmax.cu", "(int)(g.row % Tq)", "a query position, < Tq (an int)"),
    ("gelu.cu", "(int)(i0 % C)", "a column, < C (an int)"),
    ("gelu.cu", "(int)((blockIdx.x * (long long)blockDim.x + threadIdx.x) * P)",
     "a column chunk start: the grid's x extent covers ceil(C / P) threads, so the value is < C + blockDim.x * P"),
    ("common.cuh", "(unsigned int)(z >> 40)", "dropout_keep: the top 24 bits of the 64-bit hash, not an index"),
]


def strip_comments(text: str) -> str:
    """The source with comments, preprocessor lines and string literals blanked (same offsets
    and line numbers)."""
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    text = re.sub(r"//[^\n]*|^[ \t]*#[^\n]*|\"[^\"\n]*\"", lambda m: " " * len(m.group(0)), text, flags=re.M)
    return text


class Types:
    """The type of a name at a position: its last declaration before it (a flat, ordered scan:
    the kernels are small functions that do not shadow names with other types)."""

    def __init__(self, *texts: str):
        self.decls: list[tuple[int, str, str]] = []  # (position, name, kind); texts before the last at -1
        for i, text in enumerate(texts):
            base = 0 if i == len(texts) - 1 else -1
            for m in re.finditer(rf"(?<![\w.])(?<!constexpr ){_TYPE_RE}\s+(?:&\s*)?(\w+)\b(?!\s*\()", text):
                self.decls.append((base and -1 or m.start(), m.group(2), _TYPE_WORDS[m.group(1)]))
            for m in re.finditer(r"\bconstexpr\s+\w+\s+(\w+)\s*=", text):
                self.decls.append((base and -1 or m.start(), m.group(1), CONST))
            for m in re.finditer(r"\b(?:T|float|double|int|unsigned|void|char|bool|long|__nv_bfloat16|int4)\s*\*\s*"
                                 r"(?:__restrict__\s+)?(\w+)\s*[,)=;]", text):
                if m.group(1) not in _KEYWORDS:
                    self.decls.append((base and -1 or m.start(), m.group(1), PTR))
            for m in re.finditer(r"\bfloat\s+(\w+)\s*\[", text):
                self.decls.append((base and -1 or m.start(), m.group(1), FLOAT))
            # template value parameters (`template <typename T, int D, int R>`) are compile-time
            # constants: declared again just after the integer declaration the first regex saw
            for t in re.finditer(r"\btemplate\s*<([^<>]*)>", text):
                for m in re.finditer(r"\b(?:int|unsigned|long long|size_t)\s+(\w+)", t.group(1)):
                    self.decls.append((base and -1 or t.start(1) + m.start(1) + 1, m.group(1), CONST))
        self.decls.sort(key=lambda d: d[0])

    def of(self, name: str, pos: int) -> str:
        kind = UNKNOWN
        for p, n, k in self.decls:
            if p >= pos:
                break
            if n == name:
                kind = k
        return kind


_TOKEN = re.compile(r"\s*(0[xX][0-9a-fA-F]+[uUlL]*|\d+\.?\d*(?:[eE][-+]?\d+)?[fFuUlL]*|\w+|->|<<|>>|<=|>=|==|!=|&&|\|\||"
                    r"[-+*/%<>=!&|^~?:;,.()\[\]{}]|\S)")


def tokenize(text: str):
    out = []
    pos = 0
    while True:
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            break
        out.append((m.group(1), m.start(1)))
        pos = m.end()
    return out


def _cast_at(toks, i):
    """If tokens at i form a cast '(' type ')', its kind and the index after ')'."""
    if toks[i][0] != "(":
        return None
    words = []
    j = i + 1
    while j < len(toks) and re.fullmatch(r"[a-z_]+", toks[j][0]):
        words.append(toks[j][0])
        j += 1
    if words and j < len(toks) and toks[j][0] == ")" and " ".join(words) in _TYPE_WORDS:
        return _TYPE_WORDS[" ".join(words)], j + 1
    return None


def _match_paren(toks, i, step):
    depth = 0
    open_, close = ("(", ")") if step > 0 else (")", "(")
    while 0 <= i < len(toks):
        if toks[i][0] == open_:
            depth += 1
        elif toks[i][0] == close:
            depth -= 1
            if depth == 0:
                return i
        i += step
    raise ValueError("unbalanced parentheses")


def _combine(kinds):
    kinds = [k for k in kinds if k != PTR]
    if not kinds:
        return UNKNOWN
    if FLOAT in kinds:
        return FLOAT
    for k in (T64, T32, UNKNOWN, SMALL):
        if k in kinds:
            return k
    return CONST


def _kind_of_span(toks, a, b, types):
    """Kind of the expression toks[a:b] (the widest operand in it; a cast decides for what it covers)."""
    kinds = []
    i = a
    while i < b:
        cast = _cast_at(toks, i)
        if cast:
            kind, j = cast
            end = _operand_end(toks, j)
            kinds.append(kind)
            i = end
            continue
        t = toks[i][0]
        if re.fullmatch(r"\d.*|0[xX].*", t):
            kinds.append(T64 if re.search(r"[uU]?[lL][lL]$", t) else FLOAT if re.search(r"[.eEfF]", t) and
                         not t.startswith(("0x", "0X")) else CONST)
        elif t in _BUILTINS:
            kinds.append(_BUILTINS[t])
            i += 2  # .x
        elif re.fullmatch(r"\w+", t) and t not in _KEYWORDS:
            if i + 1 < b and toks[i + 1][0] == "(":  # a call: its result type is not tracked
                i = _match_paren(toks, i + 1, 1)
                kinds.append(UNKNOWN if t not in ("min", "max") else T32)
            elif i > a and toks[i - 1][0] in (".", "->"):
                kinds.append(types.of(t, toks[i][1]))  # a member: typed by its declaration
            elif i + 1 < b and toks[i + 1][0] in (".", "->"):
                pass  # the object; its member decides
            else:
                kinds.append(types.of(t, toks[i][1]))
        i += 1
    return _combine(kinds)


def _operand_end(toks, i):
    """Index after the operand that starts at i (a cast operand, a parenthesised group, a name with
    members, subscripts and calls, a literal)."""
    cast = _cast_at(toks, i)
    if cast:
        return _operand_end(toks, cast[1])
    if toks[i][0] == "(":
        return _match_paren(toks, i, 1) + 1
    i += 1
    while i < len(toks):
        if toks[i][0] in (".", "->"):
            i += 2
        elif toks[i][0] in ("(", "["):
            depth, j = 0, i
            while True:
                if toks[j][0] in "([":
                    depth += 1
                elif toks[j][0] in ")]":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            i = j + 1
        else:
            return i
    return i


def _operand_start(toks, i):
    """Index of the first token of the operand that ends at toks[i] (inclusive), with a cast
    right before it."""
    t = toks[i][0]
    if t == ")":
        i = _match_paren(toks, i, -1)
        if i > 0 and re.fullmatch(r"\w+", toks[i - 1][0]) and toks[i - 1][0] not in _KEYWORDS:
            i -= 1  # a call
    elif t == "]":
        i = _match_paren_sq(toks, i)
        return _operand_start(toks, i - 1)
    while i >= 2 and toks[i - 1][0] in (".", "->"):
        i -= 2
    if i >= 1 and toks[i - 1][0] == ")":
        j = _match_paren(toks, i - 1, -1)
        if _cast_at(toks, j):
            return j
    return i


def _match_paren_sq(toks, i):
    depth = 0
    while i >= 0:
        if toks[i][0] == "]":
            depth += 1
        elif toks[i][0] == "[":
            depth -= 1
            if depth == 0:
                return i
        i -= 1
    raise ValueError("unbalanced brackets")


def audit(text: str, common: str = "", name: str = "<source>", narrowing_ok=()) -> list[str]:
    """The 32-bit index problems of one kernel source (common.cuh's declarations in scope)."""
    code = strip_comments(text)
    types = Types(strip_comments(common), code)
    toks = tokenize(code)
    problems = []

    def where(pos):
        return f"{name}:{code.count(chr(10), 0, pos) + 1}"

    def text_of(a, b):
        return code[toks[a][1]:toks[b - 1][1] + len(toks[b - 1][0])]

    for i, (t, pos) in enumerate(toks):
        if t == "*" and i > 0:
            prev = toks[i - 1][0]
            binary = (re.fullmatch(r"\w+", prev) and prev not in _KEYWORDS) or prev in (")", "]")
            if not binary or toks[i + 1][0] in (">", ")", ",", "&"):
                continue
            if prev == ")" and _cast_at(toks, _match_paren(toks, i - 1, -1)):
                continue  # a cast to a pointer type
            a = _operand_start(toks, i - 1)
            b = _operand_end(toks, i + 1)
            ka = _kind_of_span(toks, a, i, types)
            kb = _kind_of_span(toks, i + 1, b, types)
            if ka in (T32, SMALL) and kb in (T32, SMALL) and not (ka == SMALL and kb == SMALL):
                problems.append(f"{where(pos)}: 32-bit product `{text_of(a, b)}` ({ka} x {kb})")
        cast = _cast_at(toks, i)
        if cast and cast[0] == T32:
            end = _operand_end(toks, cast[1])
            if _kind_of_span(toks, cast[1], end, types) == T64:
                expr = text_of(i, end)
                if expr not in narrowing_ok:
                    problems.append(f"{where(pos)}: 64-bit value cast to 32 bits `{expr}`")
    for m in re.finditer(r"(?<![\w.])(?:const\s+)?(unsigned int|unsigned|int)\s+(\w+)\s*=\s*([^;,]+)[;,]", code):
        init = m.group(3).strip()
        j = next(k for k, (_, p) in enumerate(toks) if p >= m.start(3))
        k_end = next((k for k, (_, p) in enumerate(toks) if p >= m.end(3)), len(toks))
        if _cast_at(toks, j) and _operand_end(toks, _cast_at(toks, j)[1]) >= k_end and \
                _cast_at(toks, j)[0] == T32:
            continue  # an explicit cast (checked above)
        if _kind_of_span(toks, j, k_end, types) == T64:
            problems.append(f"{where(m.start())}: `{m.group(1)} {m.group(2)} = {init}` narrows a 64-bit value")
    for m in re.finditer(r"(?<![\w.])(?:const\s+)?(unsigned|int)\s+(n|n_rows)\s*[,)]", code):
        problems.append(f"{where(m.start())}: element / row count `{m.group(0)[:-1]}` is 32-bit (use long long)")
    return problems


def _source(name):
    return (KERNELS_DIR / name).read_text()


@pytest.mark.parametrize("name", SOURCES)
def test_kernel_index_arithmetic_is_64_bit(name):
    ok = [text for f, text, _ in NARROWING_OK if f == name]
    problems = audit(_source(name), _source("common.cuh"), name, ok)
    assert not problems, "\n".join(problems)


def test_common_header_index_arithmetic_is_64_bit():
    ok = [text for f, text, _ in NARROWING_OK if f == "common.cuh"]
    assert not audit(_source("common.cuh"), "", "common.cuh", ok)


def test_every_allowed_narrowing_is_in_the_source():
    for f, text, why in NARROWING_OK:
        assert text in strip_comments(_source(f)), (f, text, why)


DECLS = "__device__ void k(float* y, const float* x, long long n_rows, int W, int C, int rows_per_chunk) {\n"
PLANTED = [
    # (snippet inside a kernel body, what the audit must report)
    ("const int row = blockIdx.x; y[row * W] = 0;", "32-bit product `row * W`"),
    ("const long long i = blockIdx.x * blockDim.x + threadIdx.x;", "32-bit product `blockIdx.x * blockDim.x`"),
    ("const long long i = (blockIdx.x * (int)blockDim.x + threadIdx.x) * 4;", "32-bit product"),
    ("const int i0 = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * 4;", "narrows a 64-bit value"),
    ("for (int k = 0; k < 3; ++k) y[(int)k * C] = 0;", "32-bit product `(int)k * C`"),
    ("const long long r0 = (int)blockIdx.x * rows_per_chunk;", "32-bit product `(int)blockIdx.x * rows_per_chunk`"),
    ("float* p = y + ((int)gridDim.x + blockIdx.x) * C;", "32-bit product `((int)gridDim.x + blockIdx.x) * C`"),
    ("const long long r = blockIdx.x; const int off = r * C;", "narrows a 64-bit value"),
    ("for (int r = (long long)blockIdx.x * rows_per_chunk; r < n_rows; ++r) y[r] = 0;", "narrows a 64-bit value"),
    ("const long long i = blockIdx.x; unsigned h = (unsigned)(i + 1);", "64-bit value cast to 32 bits"),
]
CLEAN = [
    "const long long row = blockIdx.x; y[row * W] = 0;",
    "const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;",
    "const int stride = blockDim.x * 4; const int t = threadIdx.x * blockDim.x;",
    "float* p = y + ((long long)gridDim.x + blockIdx.x) * C;",
    "const float a = x[0] * x[1]; const int c = blockIdx.x * 32 + threadIdx.x;",
]


@pytest.mark.parametrize("snippet,report", PLANTED)
def test_the_audit_reports_planted_32_bit_indices(snippet, report):
    problems = audit(DECLS + snippet + "\n}\n")
    assert any(report in p for p in problems), problems


@pytest.mark.parametrize("snippet", CLEAN)
def test_the_audit_accepts_64_bit_indices(snippet):
    assert audit(DECLS + snippet + "\n}\n") == []


def test_the_audit_reports_32_bit_counts():
    assert audit("__device__ void k(float* y, int n) {}\n")
