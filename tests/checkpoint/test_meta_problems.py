"""meta.json's checks (cutp.checkpoint.files `_meta_problem`, `_param_entry_problem`), field by
field: a real checkpoint's metadata (tests/fixtures/checkpoint_gpt2_names, tp 1, two optimizer
shards) passes, and each edit below is named by the first problem it makes. (Loading and `cutp
checkpoint verify` refuse what these name: tests/checkpoint/test_checkpoint.py.)"""
import copy
import json
import os

import pytest

from cutp.checkpoint.files import _meta_problem, _param_entry_problem
from cutp.checkpoint.names import stored_names_view
from cutp.models import GPTConfig

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "checkpoint_gpt2_names", "meta.json")
QKV = "layers.0.attn.qkv.weight"  # [16, 48], qkv sharding on axis 1 (2 heads of 8, tp 1)
MODEL = "model-tp00-of-01.safetensors"


def _meta():
    with open(FIXTURE) as f:
        return stored_names_view(json.load(f))


def _set(path, value):
    def edit(meta):
        *keys, last = path
        d = meta
        for k in keys:
            d = d[k]
        d[last] = value
    return edit


def _rename_file(meta):
    meta["files"]["model-tp00-of-02.safetensors"] = meta["files"].pop(MODEL)


META_EDITS = [
    (_set(["step"], -1), "step -1 is not an integer >= 0"),
    (_set(["meta_sha256"], 7), "meta_sha256 is not a string"),
    (_set(["files", MODEL], {"sha256": "x"}), f"entry for file '{MODEL}' lacks sha256/bytes"),
    (_set(["mesh", "pp_virtual"], 2), "mesh.pp_virtual is 2, not an integer >= 1 (and 1 without mesh.pp)"),
    (_set(["optimizer", "dp_shards"], 0), "optimizer.dp_shards is 0, not an integer in ["),
    (_set(["config", "n_head"], 3), "config: "),  # 16 channels over 3 heads
    (_rename_file, "files ['model-tp00-of-02.safetensors'] are not the shard files of mesh.tp 1"),
    (_set(["files", MODEL, "bytes"], 10), f"{MODEL} is listed with 10 bytes, less than the"),
    (_set(["params", QKV, "full_shape"], [16, 0]), "full_shape [16, 0] is not a list of 1 to 4 integers"),
]


def test_the_fixture_passes_and_each_edit_is_named():
    assert _meta_problem(_meta()) is None
    for edit, says in META_EDITS:
        meta = _meta()
        edit(meta)
        problem = _meta_problem(meta)
        assert problem is not None and says in problem, (says, problem)


def _qkv(**changes):
    entry = {"dtype": "float32", "full_shape": [16, 48], "real_rows": None,
             "sharding": {"axis": 1, "head_dim": 8, "kind": "qkv", "n_head": 2, "n_kv_head": 2, "tp": 1}}
    entry["sharding"].update(changes.pop("sharding", {}))
    entry.update(changes)
    return entry


def _lora_b(**spec):
    """A LoRA B of rank 4 over columns [16, 32) of a [16, 48] base sharded by columns."""
    s = {"kind": "part", "axis": 1, "tp": 2, "start": 16, "stop": 32, "base_shape": [16, 48],
         "of": {"kind": "contiguous", "axis": 1, "tp": 2}}
    s.update(spec)
    return {"dtype": "float32", "full_shape": [4, 16], "sharding": s}


CONFIG = GPTConfig.from_dict(_meta()["config"])  # n_head 2, head size 8
ENTRIES = [
    (_qkv(), None, None),
    ({"dtype": "float32", "full_shape": [4], "sharding": None}, None, None),
    (_lora_b(), None, None),
    ([16, 48], None, "entry is not an object"),
    (_qkv(dtype="int8"), None, "dtype 'int8' is not one of"),
    (_qkv(full_shape=[16, 48], real_rows=17), None, "real_rows 17 is not null or an integer in [1, 16]"),
    (_qkv(sharding={"kind": "rows"}), None, "sharding {'axis': 1, 'head_dim': 8, 'kind': 'rows'"),
    (_qkv(sharding={"n_head": "2"}), None, "sharding lacks integer fields ['n_head']"),
    (_qkv(sharding={"axis": 2}), None, "sharding axis 2 is outside the shape [16, 48]"),
    (_qkv(), 2, "sharding tp 1 differs from mesh.tp 2"),
    (_lora_b(start=32, stop=48 + 16), None, "is not columns of its base's sharding (they do not fit)"),
    (_lora_b(of={"kind": "contiguous", "axis": 0, "tp": 2}), None, "is not columns of its base's sharding"),
    (_lora_b(of={"kind": "contiguous", "axis": 1, "tp": 5}), None,
     "(sharding splits a dimension of 48 over tp 5, which does not divide it)"),  # the base's own, named inside
    ({"dtype": "float32", "full_shape": [9], "sharding": {"kind": "contiguous", "axis": 0, "tp": 2}}, None,
     "sharding splits a dimension of 9 over tp 2, which does not divide it"),
    ({"dtype": "float32", "full_shape": [16, 6], "sharding": {"kind": "gate_up", "axis": 1, "tp": 2}}, None,
     "sharding splits [gate | up] halves of 6 over tp 2, which does not divide them"),
    (_qkv(sharding={"head_dim": 4}), None, "sharding's heads do not make up the dimension of 48"),
    (_qkv(sharding={"n_head": 4, "n_kv_head": 1, "head_dim": 8}), None, None),  # (4 + 2) x 8 = 48: consistent...
    (_qkv(sharding={"n_head": 4, "n_kv_head": 1, "head_dim": 8}), "config",  # ...but not this config's heads
     "sharding's heads (n_head 4, n_kv_head 1, head_dim 8) differ from the config's"),
    (_qkv(sharding={"n_head": 1, "n_kv_head": 1, "head_dim": 16, "tp": 2}), None,
     "sharding's heads cannot be split over tp 2"),
]


@pytest.mark.parametrize("entry,tp,says", ENTRIES, ids=range(len(ENTRIES)))
def test_each_parameter_entry_problem_is_named(entry, tp, says):
    config = CONFIG if tp == "config" else None
    problem = _param_entry_problem(copy.deepcopy(entry), None if tp == "config" else tp, config)
    if says is None:
        assert problem is None
    else:
        assert problem is not None and says in problem, (says, problem)
