"""Refusals whose fixes work (issue 43): over a grid of rank counts x tp x cp x pp x dp x seq-len x
heads, every fix a refusal proposes, applied alone, is accepted by the settings resolver (in
process: derive_run_config on N ranks is what `mpiexec -n N` would resolve). And a setting that
would be ignored is refused by name."""
import itertools
import re

import pytest

from cutp.runtime.errors import ConfigError
from cutp.train.config import derive_run_config
from cutp.train.fixes import _render, proposed
from cutp.train.settings import flag_of


def _fixes(text: str) -> list:
    """(rank count or None, changed settings) of each fix a refusal (as the command line shows
    it) proposes; read independently of cutp.train.fixes."""
    out = []
    for name, options in re.findall(r"an? --([a-z-]+) from \[([0-9, ]+)\]", text):
        out += [(None, {name.replace("-", "_"): int(v)}) for v in options.split(",")]
    out += [(None, {"tp": int(v)}) for opts in re.findall(r"use tp in \[([0-9, ]+)\]", text) for v in opts.split(",")]
    for name, more in re.findall(r"omit (?:both )?--([a-z-]+)((?: and --[a-z-]+)*)", text):
        out.append((None, {n.replace("-", "_"): None for n in [name] + re.findall(r"--([a-z-]+)", more)}))
    for multiple, n in re.findall(r"start (a multiple of )?(\d+) ranks", text):
        out += [(int(n), {})] + ([(2 * int(n), {})] if multiple else [])
    out += [(None, {"seq_len": int(n)}) for n in re.findall(r"--seq-len that is a multiple of (\d+)", text)]
    for combo, n in re.findall(r"((?:--[a-z-]+ [0-9][0-9,]*(?: with )?)+) on (\d+) ranks?", text):
        out.append((int(n), {k.replace("-", "_"): int(v) for k, v in re.findall(r"--([a-z-]+) ([0-9]+)", combo)}))
    text = re.sub(r"((?:--[a-z-]+ [0-9][0-9,]*(?: with )?)+) on (\d+) ranks?", "", text)
    for combo in re.findall(r"(?:give|use|or|,) ((?:--[a-z-]+ [0-9][0-9,]*(?: with )?)+)", text):
        out.append((None, {k.replace("-", "_"): int(v) if v.isdigit() else v
                           for k, v in re.findall(r"--([a-z-]+) ([0-9]+(?:,[0-9]+)*)", combo)}))
    return out


def _grid():
    """A deterministic eleventh of rank counts x tp x cp x pp x dp x seq-len x heads (a stride prime to
    every dimension's size, so that each value of each is sampled)."""
    cells = itertools.product((1, 2, 3, 4, 6, 7, 8), (None, 1, 2, 4), (None, 2, 4), (None, 2), (None, 2), (8, 12, 16),
                              (4, 6))
    for i, (world, tp, cp, pp, dp, seq, heads) in enumerate(cells):
        if i % 11:
            continue
        given = {k: v for k, v in (("tp", tp), ("cp", cp), ("pp", pp), ("dp", dp)) if v is not None}
        yield world, {"preset": "tiny", "device": "cpu", "set": [f"n_head={heads}", f"n_embd={8 * heads}"],
                      "seq_len": seq, **given}
    # and all of the cells where cp divides the ranks, so that the sequence length is what is refused
    for world, cp, seq, heads in itertools.product((2, 4, 8), (2, 4), (6, 8, 12), (4, 6)):
        if world % cp == 0:
            yield world, {"preset": "tiny", "device": "cpu", "set": [f"n_head={heads}", f"n_embd={8 * heads}"],
                          "seq_len": seq, "cp": cp}


def check_every_fix_is_accepted(cases) -> tuple[int, int]:
    """For each (world, choices) the resolver refuses: one line, and each fix it proposes (other
    settings or another rank count) accepted. Returns (refusals, fixes checked)."""
    refused = checked = 0
    for world, choices in cases:
        try:
            derive_run_config(choices, world, world)
            continue
        except ConfigError as e:
            text = e.render(flag_of)
        refused += 1
        assert "\n" not in text and "; " in text, text
        for ranks, change in _fixes(text):
            n = ranks or world
            try:
                derive_run_config({**choices, **change}, n, n)
            except ConfigError as e:
                pytest.fail(f"on {world} ranks {choices}: {text!r} proposes {ranks or change}, refused: {e}")
            checked += 1
    return refused, checked


def test_every_fix_a_refusal_proposes_is_accepted():
    refused, checked = check_every_fix_is_accepted(_grid())
    assert refused > 60 and checked > refused, (refused, checked)


@pytest.mark.parametrize("world,given,expect", [
    # the issue's cases: the fixes proposed were refused themselves
    (7, {"tp": 2, "cp": 4}, "--cp 4 does not divide the 7 ranks; start 8 ranks (mpirun -np 8)"),
    (6, {"cp": 4, "seq_len": 8}, "--cp 4 does not divide the 6 ranks; use a --cp from [1, 2], omit --cp or start 4 "
                                 "ranks (mpirun -np 4)"),
])
def test_the_issues_refusals_propose_what_works(world, given, expect):
    with pytest.raises(ConfigError) as e:
        derive_run_config({"preset": "tiny", "device": "cpu", **given}, world, world)
    assert e.value.render(flag_of) == expect


@pytest.mark.parametrize("given,expect", [
    ({"link_latency": 2.0}, "--link-latency would be ignored: it sets the latency of the link --link-bandwidth "
                            "simulates, and none is simulated; give --link-bandwidth GB/s too, or omit --link-latency"),
    ({"cp_comm": "a2a"}, "--cp-comm would be ignored: it sets context parallelism's attention, and --cp is 1; give "
                         "--cp 2 or more, or omit --cp-comm"),
    ({"save_every": 10}, "--save-every would be ignored: it sets when checkpoints go into --out, and no --out is "
                         "given; give --out DIR, or omit --save-every"),
    # (found by a review helper: each was accepted without a word)
    # (a fix is tried with the ignored-settings check too: "use --tp 1" left it ignored)
    ({"pp_schedule": "gpipe", "tp": 2}, "--pp-schedule would be ignored: it sets the order of the pipeline stages' "
                                        "micro-batches, and --pp is 1; omit --pp-schedule"),
    ({"sample_prompt": "def"}, "--sample-prompt would be ignored: it sets the prompt of --sample-every's "
                               "generations, and --sample-every is 0 (none); give --sample-every N, or omit "
                               "--sample-prompt"),
    ({"sample_tokens": 9}, "--sample-tokens would be ignored: it sets the length of --sample-every's generations, "
                           "and --sample-every is 0 (none); give --sample-every N, or omit --sample-tokens"),
    # (layouts review, F3: each ran without a word; a dense model's MoE fields as tiny-moe's bias rate is refused)
    ({"moe_bias_update_rate": 0.01}, "--moe-bias-update-rate would be ignored: it sets the step of a "
                                     "mixture-of-experts model's correction bias, and the model is dense (n_experts "
                                     "0); use a model with a correction bias (moe_score_bias=true, e.g. --preset "
                                     "deepseek-tiny), or omit --moe-bias-update-rate"),
    ({"moe_seq_aux_loss": 0.1}, "--moe-seq-aux-loss would be ignored: it sets the sequence-wise balance loss of a "
                                "mixture-of-experts model, and the model is dense (n_experts 0); use a "
                                "mixture-of-experts model (e.g. --preset tiny-moe), or omit --moe-seq-aux-loss"),
    ({"set": ["n_layer=2", "moe_capacity_factor=1.0", "moe_z_loss_coeff=0.1"]},
     "--set moe_capacity_factor=1.0 would be ignored: it sets a field of the mixture-of-experts layers, and the model "
     "is dense (n_experts 0); use a mixture-of-experts model (n_experts=E in --set, or e.g. --preset tiny-moe), or "
     "take moe_capacity_factor=1.0 and moe_z_loss_coeff=0.1 out of --set"),
    ({"grad_reduce_dtype": "bfloat16"}, "--grad-reduce-dtype would be ignored: it sets the dtype of the DP gradient "
                                        "reduction, and there is none (dp 1, cp 1); give --dp 2 or more, or omit "
                                        "--grad-reduce-dtype"),
    ({"tp_comm_overlap": True, "tp": 1}, "--tp-comm-overlap would be ignored: it sets the overlap of the TP "
                                         "collectives and pipeline receives, and tp and pp are 1; give --tp 2 or "
                                         "more, or omit --tp-comm-overlap"),
])
def test_a_setting_that_would_be_ignored_is_refused_by_name(given, expect):
    with pytest.raises(ConfigError) as e:
        derive_run_config({"preset": "tiny", "device": "cpu", **given}, 2, 2)
    assert e.value.render(flag_of) == expect
    derive_run_config({"preset": "tiny", "device": "cpu", "link_bandwidth": 10.0, "link_latency": 2.0}, 1, 1)
    # what runs anyway (a printed config of a pp 1 run says 1f1b) and what takes effect are accepted
    derive_run_config({"preset": "tiny", "device": "cpu", "pp_schedule": "1f1b", "eval_batches": 8, "eval_every": 0,
                       "sample_prompt": "def", "sample_tokens": 9, "sample_every": 5}, 1, 1)  # (evaluate(run) reads
    # eval_batches whatever eval_every says)
    derive_run_config({"preset": "tiny", "device": "cpu", "moe_bias_update_rate": 0.0, "moe_seq_aux_loss": 0.0,
                       "set": ["moe_z_loss_coeff=0"]}, 1, 1)  # (a dense model's: what runs anyway)
    derive_run_config({"preset": "tiny-moe", "device": "cpu", "moe_seq_aux_loss": 0.1,
                       "set": ["moe_capacity_factor=1.0", "moe_z_loss_coeff=0.1"]}, 1, 1)
    derive_run_config({"preset": "tiny", "device": "cpu", "grad_reduce_dtype": "bfloat16", "tp": 1}, 2, 2)  # dp 2
    derive_run_config({"preset": "tiny", "device": "cpu", "grad_reduce_dtype": "bfloat16", "cp": 2, "tp": 1}, 2, 2)
    derive_run_config({"preset": "tiny", "device": "cpu", "tp_comm_overlap": True, "tp": 1, "pp": 2}, 2, 2)


def test_fixes_written_again_read_back_as_the_same_fixes():
    fixes = [(None, {"tp": 2, "dp": 2}), (None, {"cp": None}), (None, {"cp": None, "tp": None}), (4, {})]
    text = _render(fixes)
    assert text == "use `tp` 2 with `dp` 2, omit `cp`, omit both `cp` and `tp` or start 4 ranks (mpirun -np 4)"
    assert sorted(map(repr, proposed("problem; " + text))) == sorted(map(repr, fixes))
