"""Defaults derived from what was given (issue 26): the mesh from any of tp, dp, pp, ep; the
micro-batch a pipeline schedule needs; refusals that name the numbers and propose fixes that work."""
import itertools
import re

import pytest

from cutp.runtime.errors import ConfigError
from cutp.train.config import derive_run_config, schedule_takes
from cutp.train.settings import flag_of

TINY = {"preset": "tiny", "device": "cpu"}  # tiny: 4 heads, 4 layers
MOE = {"preset": "tiny-moe", "device": "cpu"}


def _derive(world, **choices):
    return derive_run_config({**TINY, **choices}, world, world)


def _cli(error: ConfigError) -> str:
    return error.render(flag_of)


@pytest.mark.parametrize("world,given,mesh", [
    (4, {"dp": 4}, (1, 4, 1, 1)),  # refused before: tp chosen 4, then "tp*dp = 4*4 = 16"
    (4, {"pp": 2, "dp": 2}, (1, 2, 2, 1)),  # refused before
    (4, {"pp": 2}, (2, 1, 2, 1)),
    (4, {"tp": 2}, (2, 2, 1, 1)),
    (4, {}, (4, 1, 1, 1)),
    (2, {"pp": 2}, (1, 1, 2, 1)),
    (8, {"pp": 2, "dp": 2}, (2, 2, 2, 1)),
])
def test_the_mesh_not_given_is_derived_from_what_was(world, given, mesh):
    cfg = _derive(world, **given)
    assert (cfg.tp, cfg.dp, cfg.pp, cfg.ep) == mesh


@pytest.mark.parametrize("world,given,mesh", [
    (4, {"dp": 2, "ep": 2}, (2, 2, 1, 2)),
    (4, {"ep": 2}, (2, 2, 1, 2)),  # tp chosen so that ep divides dp (tp 4 would leave dp 1)
    (4, {"ep": 4}, (1, 4, 1, 4)),
    (4, {"ep": 2, "pp": 2}, (1, 2, 2, 2)),
])
def test_ep_is_carved_from_a_dp_derived_to_hold_it(world, given, mesh):
    cfg = derive_run_config({**MOE, **given}, world, world)
    assert (cfg.tp, cfg.dp, cfg.pp, cfg.ep) == mesh


def test_each_combination_of_given_and_omitted_tp_dp_pp_ep_runs_or_is_refused_with_a_fix_that_works():
    """On 4 ranks, an MoE model (4 heads, 4 experts): every combination of tp, dp, pp, ep given
    (as 1, 2 or 4) or omitted gives a config of the given sizes whose product is the world, or
    one line whose proposed fixes, each applied alone, give a config."""
    seen = 0
    for values in itertools.product((None, 1, 2, 4), repeat=4):
        given = {k: v for k, v in zip(("tp", "dp", "pp", "ep"), values) if v is not None}
        try:
            cfg = derive_run_config({**MOE, "set": ["n_layer=4"], **given}, 4, 4)
        except ConfigError as e:
            text = str(e)
            assert "\n" not in text and text, given
            for fix in _mesh_fixes(text):
                derive_run_config({**MOE, "set": ["n_layer=4"], **given, **fix}, 4, 4)
            continue
        seen += 1
        assert cfg.tp * cfg.dp * cfg.pp == 4 and cfg.dp % cfg.ep == 0, given
        assert all(getattr(cfg, k) == v for k, v in given.items()), (given, cfg.tp, cfg.dp, cfg.pp, cfg.ep)
    assert seen >= 20


def _mesh_fixes(text: str) -> list[dict]:
    """The fixes a mesh refusal proposes, as choices: "omit dp", "use a tp from [1, 2]", ..."""
    fixes = [{name: None} for name in re.findall(r"omit (tp|dp)\b", text)]
    for name, options in re.findall(r"use an? (tp|dp|pp|ep) from \[([0-9, ]+)\]", text):
        fixes += [{name: int(v)} for v in options.split(",")]
    return fixes


def test_a_mesh_that_cannot_be_made_names_the_numbers_and_the_flags():
    with pytest.raises(ConfigError) as e:
        _derive(4, tp=4, dp=4)
    assert _cli(e.value) == ("tp*dp = 4*4 = 16 but the communicator has 4 ranks; start 16 ranks (mpirun -np 16); "
                             "omit --dp (it would be 1); omit --tp (it would be 1)")
    with pytest.raises(ConfigError) as e:
        _derive(4, dp=3)
    assert _cli(e.value).startswith("dp=3 does not divide the world size 4, so tp cannot be derived; use a --dp "
                                    "from [1, 2, 4]")


# ---- the micro-batch a pipeline needs ------------------------------------------------------
@pytest.mark.parametrize("world,given,batch,micro", [
    (2, {"pp": 2}, 8, 4),  # refused before: the micro-batch was the whole batch, 1 micro-batch
    (4, {"pp": 4, "tp": 1}, 8, 2),
    (4, {"pp": 2, "dp": 2}, 8, 2),
    (2, {"pp": 2, "pp_schedule": "gpipe"}, 8, 4),
    (2, {"pp": 2, "pp_virtual": 2}, 8, 4),
    (4, {"pp": 4, "pp_virtual": 2, "tp": 1, "set": ["n_layer=8"]}, 8, 2),
    (3, {"pp": 3, "set": ["n_layer=3"]}, 8, 2),  # 1f1b: at least 3 micro-batches of the 8 sequences: 4 of 2
    (3, {"pp": 3, "pp_virtual": 2, "set": ["n_layer=6"]}, 9, 3),  # interleaved: 8 has no multiple of 3: 9
    (2, {"pp": 2, "batch_size": 6}, 6, 3),
    (1, {}, 8, 8),  # no pipeline: the whole per-rank batch, as before
    (4, {"dp": 4}, 8, 2),
])
def test_without_a_micro_batch_size_the_schedule_gets_its_micro_batches(world, given, batch, micro):
    cfg = _derive(world, **given)
    assert (cfg.batch_size, cfg.micro_batch_size) == (batch, micro)
    assert schedule_takes(cfg.pp_schedule, cfg.pp, cfg.accum_steps) and cfg.accum_steps >= cfg.pp


def test_a_pipeline_batch_too_small_proposes_only_what_works():
    with pytest.raises(ConfigError) as e:
        _derive(2, pp=2, batch_size=1)
    text = _cli(e.value)
    assert text == ("the 1F1B schedule needs at least pp=2 micro-batches per step, and --batch-size 1 / (dp 1 x "
                    "--micro-batch-size 1) gives 1; use --batch-size 2 or --pp-schedule gpipe")
    for fix in ({"batch_size": 2}, {"batch_size": 1, "pp_schedule": "gpipe"}):
        _derive(2, pp=2, **{"batch_size": 1, **fix})
    with pytest.raises(ConfigError) as e:
        _derive(2, pp=2, micro_batch_size=8)
    assert _cli(e.value).endswith("use --micro-batch-size 4 (or smaller), --batch-size 16 or --pp-schedule gpipe")
    for fix in ({"micro_batch_size": 4}, {"batch_size": 16}, {"pp_schedule": "gpipe"}):
        _derive(2, pp=2, **{"micro_batch_size": 8, **fix})
    with pytest.raises(ConfigError) as e:
        _derive(2, pp=2, pp_virtual=2, micro_batch_size=3, batch_size=9)
    # 9 sequences split into an even number of micro-batches at no size: only a larger batch does
    assert _cli(e.value).endswith("gives 3; use --batch-size 12"), _cli(e.value)
    for fix in ({"batch_size": 12},):
        _derive(2, pp=2, pp_virtual=2, **{"micro_batch_size": 3, "batch_size": 9, **fix})


# ---- fewer layers than pipeline chunks ---------------------------------------------------------
def test_fewer_layers_than_stages_says_n_layer_must_be_at_least_pp_times_v():
    with pytest.raises(ConfigError) as e:
        _derive(3, pp=3, set=["n_layer=2"])
    assert _cli(e.value) == ("n_layer=2 cannot fill pp=3 stages: each needs at least one layer, so n_layer must be "
                             "at least pp x V = 3 x 1 = 3; use a model of at least 3 layers (n_layer=3)")
    assert "--pp-layers 0" not in _cli(e.value)
    _derive(3, pp=3, set=["n_layer=3"])
    with pytest.raises(ConfigError) as e:
        _derive(2, pp=2, pp_virtual=2, set=["n_layer=3"])
    assert _cli(e.value) == ("n_layer=3 cannot fill pp=2 x --pp-virtual 2 = 4 model chunks: each needs at least one "
                             "layer, so n_layer must be at least pp x V = 2 x 2 = 4; use a model of at least 4 layers "
                             "(n_layer=4) or no --pp-virtual (and --pp-layers 1,2)")
    _derive(2, pp=2, set=["n_layer=3"], pp_layers="1,2")
    _derive(2, pp=2, pp_virtual=2, set=["n_layer=4"])


# ---- sequence parallelism needs tp > 1 -----------------------------------------------------
def test_sequence_parallel_at_tp_1_is_refused_in_one_line_with_the_tp_that_would_work():
    with pytest.raises(ConfigError) as e:
        _derive(2, tp=1, sequence_parallel=True)
    assert _cli(e.value) == ("--sequence-parallel needs tp > 1 (it splits the activations over the TP ranks), but "
                             "tp is 1; give --tp 2, or omit --sequence-parallel")
    with pytest.raises(ConfigError) as e:
        _derive(4, dp=4, sequence_parallel=True)
    assert _cli(e.value).endswith("give --tp 2 with --dp 2 or --tp 4 with --dp 1, or omit --sequence-parallel")
    _derive(4, tp=2, dp=2, sequence_parallel=True)
    _derive(4, tp=4, dp=1, sequence_parallel=True)
    with pytest.raises(ConfigError) as e:  # tp chosen for the machine: 1 on one rank
        _derive(1, sequence_parallel=True)
    assert _cli(e.value) == ("--sequence-parallel needs tp > 1 (it splits the activations over the TP ranks), but "
                             "tp is 1 (chosen for 1 rank); omit --sequence-parallel (no tp > 1 suits the model and "
                             "the mesh on 1 rank)")
    assert _derive(2, sequence_parallel=True).tp == 2  # chosen > 1: accepted


def test_a_tp_proposed_suits_the_model():
    """A model of 6 heads on 4 ranks: tp 4 divides the ranks but not the heads, so it is not
    proposed."""
    with pytest.raises(ConfigError) as e:
        _derive(4, tp=3, set=["n_head=6", "n_embd=48"])
    assert _cli(e.value) == ("tp=3 does not divide the world size 4, so dp cannot be derived; use a --tp from "
                             "[1, 2] or start a multiple of 3 ranks")
    with pytest.raises(ConfigError) as e:
        _derive(4, tp=1, dp=2, set=["n_head=6", "n_embd=48"])
    assert _cli(e.value) == "tp*dp = 1*2 = 2 but the communicator has 4 ranks; start 2 ranks (mpirun -np 2); " \
                            "omit --dp (it would be 4); omit --tp (it would be 2)"
    with pytest.raises(ConfigError) as e:
        _derive(4, dp=1, set=["n_head=6", "n_embd=48"])  # tp would be 4: not a divisor of 6 heads
    assert _cli(e.value) == ("--dp 1 leaves tp = 4 / (dp 1 x pp 1) = 4, but tp=4 does not divide n_head=6: attention "
                             "is split by whole heads; use a --dp from [2, 4]")
    assert _derive(4, dp=2, set=["n_head=6", "n_embd=48"]).tp == 2
    # a model no dp makes valid: its own error, as without --dp (was "... use a --dp from []")
    with pytest.raises(ConfigError) as e:
        _derive(2, dp=2, set=["bos_token_id=999"])
    assert _cli(e.value).startswith("bos_token_id must be a token id in [0, 256) or None, got 999")


def test_the_moe_balance_flags_set_the_model_fields():
    """--moe-bias-update-rate R and --moe-seq-aux-loss ALPHA are --set moe_bias_update_rate=R and
    --set moe_seq_aux_loss=ALPHA; a bias rate on a model without the correction bias is refused."""
    from cutp.train.config import command_line_parser

    args = vars(command_line_parser().parse_args(["--preset", "deepseek-tiny", "--moe-bias-update-rate", "0.002",
                                                  "--moe-seq-aux-loss", "1e-4"]))
    cfg = derive_run_config({**args, "device": "cpu"}, 1, 1)
    assert (cfg.model.moe_bias_update_rate, cfg.model.moe_seq_aux_loss) == (0.002, 1e-4)
    same = derive_run_config({**TINY, "preset": "deepseek-tiny", "set": ["moe_bias_update_rate=0.002",
                                                                        "moe_seq_aux_loss=1e-4"]}, 1, 1)
    assert same.model == cfg.model
    with pytest.raises(ConfigError) as e:  # (it read ">= 0" of 0.01 as the problem: layouts review, F4)
        derive_run_config({**MOE, "moe_bias_update_rate": 0.01}, 1, 1)
    assert str(e.value) == ("moe_bias_update_rate=0.01 needs moe_score_bias=true, and this model has no correction "
                            "bias; use a model with one (moe_score_bias=true with moe_scoring=sigmoid, e.g. the preset "
                            "deepseek-tiny), or omit moe_bias_update_rate")
    with pytest.raises(ConfigError, match=r"^moe_bias_update_rate must be >= 0 \(0: the bias stays\), got -0.5$"):
        derive_run_config({**MOE, "preset": "deepseek-tiny", "moe_bias_update_rate": -0.5}, 1, 1)
