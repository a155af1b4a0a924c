"""The safetensors headers' checks (cutp.checkpoint.files `safetensors_header`, `_header_problem`),
each problem by itself: the real headers of a checkpoint (tests/fixtures/checkpoint_gpt2_names: tp 1,
the optimizer state in two dp shards) pass, and each edit below is named by the problem it makes.
(`cutp checkpoint verify` and loading report what these name: tests/checkpoint/test_checkpoint.py.)"""
import copy
import io
import json
import os

import pytest

from cutp.checkpoint.files import _header_problem, safetensors_header, shard_shape
from cutp.checkpoint.names import stored_names_view

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "checkpoint_gpt2_names")
MODEL = "model-tp00-of-01.safetensors"
OPTIM = "optim-tp00-of-01-dp00-of-02.safetensors"
WEIGHT = "h.0.attn.c_attn.weight"  # (the fixture stores GPT-2's names; the messages say cutp's)
QKV = "layers.0.attn.qkv.weight"


def _meta():
    with open(os.path.join(FIXTURE, "meta.json")) as f:
        return stored_names_view(json.load(f))


def _header(fname):
    path = os.path.join(FIXTURE, fname)
    with open(path, "rb") as f:
        return safetensors_header(f, os.path.getsize(path))


def _offsets(h, edit):
    offsets = json.loads(h["__metadata__"]["offsets"])
    edit(offsets)
    h["__metadata__"]["offsets"] = json.dumps(offsets)


HEADER_EDITS = [  # (file, edit of its header, the problem named)
    (MODEL, lambda h: h[WEIGHT].update(shape="16x48"), f"tensor {QKV!r} has a malformed header entry"),
    (MODEL, lambda h: h.update(extra={"dtype": "F32", "shape": [1]}), "holds tensors ['extra'] meta.json does not list"),
    (MODEL, lambda h: h.pop(WEIGHT), f"lacks [{QKV!r}]"),
    (MODEL, lambda h: h[WEIGHT].update(dtype="F64"), "meta.json says F32 [16, 48]"),
    (OPTIM, lambda h: h["__metadata__"].update(offsets="{not json"), "its offsets metadata is malformed"),
    (OPTIM, lambda h: h["__metadata__"].update(offsets="[1, 2]"), "its offsets metadata is malformed"),
    (OPTIM, lambda h: h.update({"momentum.x": {"dtype": "F32", "shape": [1]}}), "of no parameter meta.json lists"),
    (OPTIM, lambda h: h[f"exp_avg.{WEIGHT}"].update(dtype="BF16"), "is BF16, not float32 or float64"),
    (OPTIM, lambda h: _offsets(h, lambda o: o.update({WEIGHT: [0, 769]})), "does not fit its shape"),
    (OPTIM, lambda h: _offsets(h, lambda o: o.update({WEIGHT: [5, 5]})), "does not fit its shape"),
    (OPTIM, lambda h: _offsets(h, lambda o: o.pop(WEIGHT)), "the piece None of"),
]


@pytest.mark.parametrize("fname,edit,problem", HEADER_EDITS, ids=[f"{f[:5]}-{p[:30]}" for f, _, p in HEADER_EDITS])
def test_each_header_problem_is_named(fname, edit, problem):
    meta, header = _meta(), _header(fname)
    assert _header_problem(copy.deepcopy(header), meta, fname) is None  # (the real header passes)
    edit(header)
    got = _header_problem(header, meta, fname)
    assert got is not None and problem in got, got


def test_a_whole_optimizer_file_holds_both_moments_of_every_parameter_at_its_shard_shape():
    """An optimizer file not split over dp (no -dpNN- in its name): each parameter's two moments,
    whole, at the shard's shape; a buffer has none."""
    meta = _meta()
    meta.pop("stored_names", None)  # (cutp's own names in the header below)
    fname = "optim-tp00-of-01.safetensors"
    header = {f"{m}.{name}": {"dtype": "F32", "shape": list(shard_shape(info))}
              for name, info in meta["params"].items() for m in ("exp_avg", "exp_avg_sq")}
    assert _header_problem(copy.deepcopy(header), meta, fname) is None
    name = next(iter(meta["params"]))
    wrong = copy.deepcopy(header)
    wrong[f"exp_avg.{name}"]["shape"] = [1, 2, 3]
    assert "has shape [1, 2, 3], meta.json says" in _header_problem(wrong, meta, fname)
    header.pop(f"exp_avg_sq.{name}")
    assert _header_problem(header, meta, fname) == f"lacks tensors ['exp_avg_sq.{name}']"


@pytest.mark.parametrize("data,problem", [
    (b"\x07\x00", "header length -1 does not fit the file"),
    ((10 ** 6).to_bytes(8, "little") + b"{}", "header length 1000000 does not fit the file"),
    ((1).to_bytes(8, "little") + b"{", "header length 1 does not fit the file"),
    ((2).to_bytes(8, "little") + b"[]", "the header is not an object"),
])
def test_a_damaged_safetensors_header_is_named(data, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(")):
        safetensors_header(io.BytesIO(data), len(data))
