"""Training through the library alone (cutp.train), as a host code embedding cutp would: no
script, on sub-communicators of its own; and RunConfig's defaults, checks and freezing."""
import dataclasses
import json
import time

import numpy as np
import pytest
from mpi4py import MPI

import cutp
from cutp import train
from cutp.models import GPTConfig
from cutp.runtime.watchdog import Watchdog
from tests.mpirun import run_mpi

SMALL = dict(preset="tiny", set=["n_layer=1"], dtype="float64", seq_len=16, batch_size=4, eval_every=0,
             device="cpu", quiet=True, save_on_signal=False)


def _worker_two_programs_on_halves_of_the_world(out_dir):
    """Ranks 0-1 train at tp=2, ranks 2-3 at tp=1 x dp=2, each half on its own sub-communicator
    of COMM_WORLD; both get the losses of the same model (float64, within 1e-10). Then half 0
    resumes its step-2 checkpoint through the library and repeats step 3 bit for bit."""
    world = MPI.COMM_WORLD
    half = world.Split(color=world.rank // 2, key=world.rank)
    mesh = {"tp": 2} if world.rank < 2 else {"tp": 1, "dp": 2, "micro_batch_size": 1}
    out = f"{out_dir}/half{world.rank // 2}"
    cfg = train.resolve_run_config(half, steps=3, out=out, **SMALL, **mesh)
    assert (cfg.tp, cfg.dp, cfg.batch_size, cfg.seq_len) == (mesh["tp"], 2 // mesh["tp"], 4, 16)
    run = train.build_run(cfg, half)
    assert run.ctx.world_size == 2 and run.ctx.mpi_comm is half
    losses, saved = [], None
    while run.step < run.end_step:
        stats = train.train_step(run)
        assert stats.step == run.step and not stats.skipped and stats.forward_ms > 0 and stats.comm_bytes > 0
        losses.append(stats.loss)
        if run.step == 2:
            saved = train.save(run)
    val = train.evaluate(run)
    run.close()
    mine = np.array(losses + [val])
    every = np.empty((world.size, mine.size))
    world.Allgather(mine, every)
    np.testing.assert_allclose(every[2], every[0], rtol=1e-10, atol=0)  # tp=2 and tp=1 x dp=2: same math
    assert every[0][-2] < every[0][0], "the loss did not go down"
    if world.rank < 2:
        again = train.resolve_run_config(half, resume=saved, **{k: v for k, v in SMALL.items() if k not in ("set", "preset")},
                                         tp=2)
        assert again.resumed_step == 2 and again.steps == 3
        rerun = train.build_run(again, half)
        assert rerun.step == 2
        assert train.train_step(rerun).loss == losses[2]  # bit-identical after resume
        rerun.close()
    half.Free()


def test_train_a_few_steps_through_the_library_on_sub_communicators(tmp_path):
    run_mpi(4, "tests.train.test_library:_worker_two_programs_on_halves_of_the_world", str(tmp_path), timeout=180)


def _worker_hooks_see_every_phase():
    cfg = train.resolve_run_config(MPI.COMM_WORLD, tp=2, steps=2, micro_batch_size=2, **SMALL)
    run = train.build_run(cfg)
    seen = []

    class Record(train.StepHooks):
        def phase(self, name):
            seen.append(name)

        def after_forward(self, run, micro):
            seen.append(f"after_forward {micro}")

        def before_grad_sync(self, run):
            seen.append("before_grad_sync")

    stats = train.train_step(run, Record(), profile=True)
    assert seen == ["optimizer", "forward", "after_forward 0", "backward", "forward", "after_forward 1", "backward",
                    "optimizer", "before_grad_sync"], seen
    assert abs(stats.forward_ms + stats.backward_ms + stats.optimizer_ms - stats.ms) < 0.05 * stats.ms + 1
    assert stats.record()["comm_mb"] == stats.comm_bytes / 1e6
    run.close()


def test_step_hooks_see_every_phase_and_micro_batch():
    run_mpi(2, "tests.train.test_library:_worker_hooks_see_every_phase", timeout=120)


# ---- RunConfig ------------------------------------------------------------------------------------
def _resolve(**choices):
    return train.resolve_run_config(MPI.COMM_SELF, **{"device": "cpu", **choices})


def test_defaults_are_derived_from_the_choices_and_the_world():
    cfg = _resolve(steps=100)
    assert cfg.preset == "tiny" and cfg.model == GPTConfig.preset("tiny")
    assert (cfg.tp, cfg.dp, cfg.batch_size, cfg.micro_batch_size, cfg.accum_steps) == (1, 1, 8, 8, 1)
    assert cfg.seq_len == 128 and cfg.lr == 1e-3 and cfg.warmup == 5 and cfg.steps == 100
    big = _resolve(preset="gpt2", steps=10)
    assert big.lr == 6e-4 and big.seq_len == 256 and big.warmup == 1  # at most 256 tokens on the CPU
    assert _resolve(micro_batch_size=2).accum_steps == 4


def test_a_model_config_given_whole_keeps_its_fields():
    model = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=300, block_size=16, dropout=0.25)
    cfg = _resolve(model=model, set=["n_head=4"])
    assert cfg.preset is None and cfg.model.dropout == 0.25 and cfg.model.n_head == 4 and cfg.seq_len == 16
    assert _resolve(model=model.to_dict(), dropout=0.0).model.dropout == 0.0


def test_choose_tp_fits_the_node_and_the_model():
    tiny = GPTConfig.preset("tiny")
    assert train.choose_tp(8, 8, tiny, "cpu") == 4  # at most 4 CPU ranks per TP group
    assert train.choose_tp(8, 8, tiny, "cuda") == 8
    assert train.choose_tp(6, 6, tiny, "cuda") == 2  # 6 and 3 do not divide 8 heads
    assert train.choose_tp(16, 2, tiny, "cuda") == 2  # inside a node


@pytest.mark.parametrize("choices,message", [
    ({"bogus": 1}, "unknown run settings ['bogus']"),
    ({"seq_len": 512}, "seq_len 512 exceeds the model's block_size 128"),
    ({"micro_batch_size": 3}, "micro_batch_size 3 must divide the per-DP-rank batch 8"),
    ({"tp": 3}, "tp=3 does not divide n_head=8"),
    ({"tp": 2}, "tp=2 does not divide the world size 1"),
    ({"dp": 2}, "dp=2 does not divide the world size 1, so tp cannot be derived"),  # tp derived from dp
    ({"tp": 1, "dp": 2}, "tp*dp = 1*2 = 2 but the communicator has 1 ranks; start 2 ranks"),
    ({"lr": -1.0}, "lr must be a finite number > 0"),
    ({"steps": -1}, "steps must be an integer >= 0"),
    ({"eval_batches": 0}, "eval_batches must be an integer >= 1"),
    ({"preset": "huge"}, "unknown preset 'huge'"),
    ({"set": ["n_layer=0"]}, "n_layer must be a positive integer"),
    ({"collective_timeout": -2}, "collective_timeout=-2 is not a number of seconds"),
])
def test_bad_choices_are_refused_with_the_fix(choices, message):
    with pytest.raises(cutp.ConfigError) as e:
        _resolve(**choices)
    assert message in str(e.value), str(e.value)


def test_run_config_is_frozen_and_checks_itself():
    cfg = _resolve()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 0.1
    with pytest.raises(cutp.ConfigError, match="batch_size 9 must be divisible by dp=2"):
        dataclasses.replace(cfg, dp=2, batch_size=9)
    with pytest.raises(cutp.ConfigError, match="device must be 'cpu' or 'cuda'"):
        dataclasses.replace(cfg, device="auto")
    d = cfg.to_dict()
    json.dumps(d)  # JSON-ready
    assert d["model"]["n_layer"] == 4 and d["batch_size"] == 8
    settings = cfg.checkpoint_settings()
    assert all(k in settings for k in train.RUN_SETTINGS) and settings["preset"] == "tiny"


def test_resume_takes_the_run_settings_and_refuses_contradictions(tmp_path):
    cfg = _resolve(steps=4, lr=0.002, seq_len=16, batch_size=4, set=["n_layer=1"], out=str(tmp_path / "run"),
                   eval_every=0)
    run = train.build_run(cfg, MPI.COMM_SELF)
    train.train_step(run)
    path = train.save(run)
    assert train.save(run) is None  # this step is saved already
    run.close()
    again = _resolve(resume=str(tmp_path / "run"), steps=6, run_steps=2)
    assert (again.lr, again.seq_len, again.batch_size, again.resumed_step, again.steps) == (0.002, 16, 4, 1, 6)
    assert again.resume == path and again.model.n_layer == 1 and again.preset == "tiny"
    rerun = train.build_run(again, MPI.COMM_SELF)
    assert (rerun.start_step, rerun.step, rerun.end_step) == (1, 1, 3)  # run_steps counts from the checkpoint
    # a RunConfig made by hand must continue the checkpoint's training, not silently change it
    changed = dataclasses.replace(rerun, config=dataclasses.replace(again, lr=0.005))
    with pytest.raises(cutp.ConfigError, match=r"lr 0.005 \(the checkpoint's 0.002\)"):
        train.resume(changed, path)
    rerun.close()
    with pytest.raises(cutp.ConfigError, match="resume is set but resumed_step is not"):
        dataclasses.replace(again, resumed_step=None)
    with pytest.raises(cutp.ConfigError, match="lr 0.1 differs from the resumed run's 0.002"):
        _resolve(resume=path, lr=0.1)
    with pytest.raises(cutp.ConfigError, match="n_layer: checkpoint 1, flags 4"):
        _resolve(resume=path, preset="tiny")


# ---- the watchdog over a whole step -------------------------------------------------------------------
def _watch(monkeypatch, timeout, body):
    fired = []
    monkeypatch.setattr(Watchdog, "_fire", lambda self, desc, waited, timeout, scope=False, others=(): fired.append(
        (desc, scope, list(others))))
    wd = Watchdog(timeout, rank=0)
    try:
        with wd.watch_progress("training step 7"):
            body(wd)
    finally:
        wd.close()
    return fired


def test_a_step_that_makes_progress_is_not_aborted_however_long_it_takes(monkeypatch):
    def body(wd):
        for _ in range(8):  # 0.8 s in all, four times the timeout, progress every 0.1 s
            time.sleep(0.1)
            wd.progress()

    assert _watch(monkeypatch, 0.2, body) == []


def test_a_stalled_step_is_aborted_naming_what_is_in_flight(monkeypatch):
    def body(wd):
        with wd.guard("all_reduce on group 'dp'"):
            time.sleep(0.8)  # a peer that never comes

    fired = _watch(monkeypatch, 0.2, body)
    assert fired and fired[0] == ("all_reduce on group 'dp'", False, ["training step 7"]), fired
    assert ("training step 7", True, ["all_reduce on group 'dp'"]) in fired


def test_data_that_cannot_feed_the_run_is_refused_before_the_context():
    from cutp.data import Dataset

    cfg = _resolve(seq_len=16, batch_size=4, set=["n_layer=1"])
    short = Dataset(np.arange(10) % 256, np.arange(100) % 256, 256, "ten tokens")
    with pytest.raises(ValueError, match="the train split has 10 tokens, fewer than seq_len"):
        train.build_run(cfg, MPI.COMM_SELF, dataset=short)
    wide = Dataset(np.arange(1000), np.arange(1000), 1000, "a 1000-token vocabulary")
    with pytest.raises(cutp.ConfigError, match="token ids up to 999 but the model's vocabulary is 256"):
        train.build_run(cfg, MPI.COMM_SELF, dataset=wide)
    with pytest.raises(cutp.ConfigError, match="not both"):
        train.build_run(dataclasses.replace(cfg, data="x.txt"), MPI.COMM_SELF, dataset=wide)


@pytest.mark.parametrize("flag,value,message", [
    ("batch_size", 0, "batch_size must be an integer >= 1, got 0"),
    ("seq_len", 0, "seq_len must be an integer >= 1, got 0"),
    ("micro_batch_size", 0, "micro_batch_size must be an integer >= 1, got 0"),
    ("tp", 0, "tp must be an integer >= 1, got 0"),
    ("dp", 0, "dp must be an integer >= 1, got 0"),
    ("lr", 0.0, "lr must be a finite number > 0, got 0.0"),
])
def test_a_zero_is_refused_not_taken_for_the_default(flag, value, message):
    """Issue 16: `x or default` turned a given 0 into the default; 0 is a value, and refused."""
    with pytest.raises(cutp.ConfigError, match=message):
        train.resolve_run_config(MPI.COMM_SELF, **{**SMALL, flag: value})


def test_the_metrics_directory_is_made_or_refused_at_start(tmp_path):
    target = tmp_path / "new" / "deeper" / "m.jsonl"
    train.resolve_run_config(MPI.COMM_SELF, **SMALL, metrics=str(target))
    assert target.parent.is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(cutp.ConfigError, match="cannot create its directory"):
        train.resolve_run_config(MPI.COMM_SELF, **SMALL, metrics=str(tmp_path / "file" / "m.jsonl"))


def test_gather_state_dict_returns_copies_never_the_live_parameters():
    """Issue 16: replicated parameters (LayerNorm, position embeddings) came back as the model's
    own arrays, so editing the returned dict edited the model."""
    from cutp.models import GPT

    model = GPT(cutp.init(comm=MPI.COMM_SELF, tp=1), GPTConfig.preset("tiny", n_layer=1), seed=0)
    sd = model.gather_state_dict()
    for name, a in sd.items():
        a[...] = 7
    assert not any(np.all(p.data == 7) for p in model.parameters())


def test_a_resumed_metrics_file_drops_a_torn_last_line_and_refuses_a_corrupt_middle(tmp_path, capsys):
    """Issue 16: a crash mid-write left a cut last line, and --resume failed on it with a bare
    JSONDecodeError."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n{"step": 3, "lo')
    log = train.MetricsLog(str(path), 0, resumed_step=2)
    log.write({"step": 3, "loss": 3.0})
    log.close()
    assert [json.loads(ln)["step"] for ln in path.read_text().splitlines()] == [1, 2, 3]
    assert "last line was cut short" in capsys.readouterr().err
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        train.MetricsLog(str(path), 0, resumed_step=2)


def test_hugging_face_labels_are_shifted_by_targets_from_labels():
    """Issue 16: forward takes shifted targets; an HF user passing labels=input_ids got a wrong
    loss silently. targets_from_labels gives HF's loss: the mean over the T-1 next tokens."""
    from cutp.models import GPT

    model = GPT(cutp.init(comm=MPI.COMM_SELF, tp=1), GPTConfig.preset("tiny", n_layer=1, dtype="float64"), seed=0)
    ids = np.random.default_rng(0).integers(0, 256, (2, 16))
    hf = model.forward(ids, model.targets_from_labels(ids))
    assert abs(hf - model.forward(ids[:, :-1], ids[:, 1:])) < 1e-12  # the causal model: the same positions
    assert abs(hf - model.forward(ids, ids)) > 1e-3  # what an unshifted call computes instead


def test_api_surprises_of_a_hugging_face_user(tmp_path):
    """Issue 16: save_hf_gpt2(model, path) needed an explicit None config; a foreign tensor as
    input failed with "'torch.dtype' object has no attribute 'kind'"."""
    from cutp.hf import save_hf_gpt2
    from cutp.models import GPT

    model = GPT(cutp.init(comm=MPI.COMM_SELF, tp=1), GPTConfig.preset("tiny", n_layer=1), seed=0)
    save_hf_gpt2(model, str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "model.safetensors").exists() and (tmp_path / "hf" / "config.json").exists()

    class ForeignTensor:  # what a torch tensor looks like to cutp: a dtype that is not NumPy's
        dtype, ndim, shape = "torch.int64", 2, (1, 4)

    with pytest.raises(TypeError, match="token ids must be a NumPy .* integer array, got .*ForeignTensor"):
        model.check_inputs(ForeignTensor())


def test_set_gelu_none_is_the_string_and_optional_fields_take_none():
    """Issue 16 (found on the way): --set gelu=none became None (then refused), so the exact-erf
    GeLU could not be chosen from the command line."""
    c = GPTConfig.preset("tiny").with_overrides(["gelu=none", "n_kv_head=none", "mlp_hidden=256"])
    assert c.gelu == "none" and c.n_kv_head is None and c.mlp_hidden == 256
    c.validate(1)


def test_set_takes_a_tuple_field_comma_separated():
    c = GPTConfig.preset("gemma-tiny").with_overrides(["layer_types=full_attention,sliding_attention,"
                                                       "full_attention,full_attention", "sliding_window=16"])
    assert c.layer_types == ("full_attention", "sliding_attention", "full_attention", "full_attention")
    assert [c.layer_window(i) for i in range(4)] == [None, 16, None, None]
    c.validate(1)


@pytest.mark.parametrize("item,expect", [
    ("n_layer=abc", "set 'n_layer=abc': 'abc' is not a value of n_layer (int)"),
    ("norm_eps=x", "set 'norm_eps=x': 'x' is not a value of norm_eps (float)"),
    ("bias=ture", "set 'bias=ture': 'ture' is not a value of bias (bool: true or false)"),  # a typo was silently False
])
def test_set_refuses_a_value_of_the_wrong_type_in_one_line(item, expect):
    """A value int()/float() cannot read was a traceback (ValueError), and any bool other than
    1/true/yes was False (found by a review helper, F3)."""
    with pytest.raises(cutp.ConfigError) as e:
        GPTConfig.preset("tiny").with_overrides([item])
    assert str(e.value) == expect
    assert GPTConfig.preset("tiny").with_overrides(["bias=No"]).bias is False



def test_set_takes_a_string_field_whose_default_is_none():
    """family's default is None (the spec's): --set family=mistral was read as an int (a
    traceback); a str field takes the text (found by a review helper)."""
    c = GPTConfig.preset("llama-tiny").with_overrides(["family=mistral", "n_kv_head=2"])
    assert c.family == "mistral"
    c.validate(1)

def test_a_model_its_family_cannot_export_is_said_at_the_start(capsys):
    """deepseek-tiny with its dense layer last trains (cutp computes it) but export-hf refuses it
    (DeepSeek-V3's dense layers are the first ones): one warning line at the start, not a surprise
    after the training (found by a review helper)."""
    from mpi4py import MPI

    from cutp.train import resolve_run_config

    common = dict(preset="deepseek-tiny", device="cpu", steps=1, quiet=True, save_on_signal=False)
    capsys.readouterr()
    resolve_run_config(MPI.COMM_SELF, **common, set=["moe_dense_layers=3"])
    assert capsys.readouterr().err == ("warning: export-hf will refuse this deepseek_v3 model: DeepSeek-V3's dense "
                                       "layers are the first ones (first_k_dense_replace) and it is dropless\n")
    resolve_run_config(MPI.COMM_SELF, **common)
    assert capsys.readouterr().err == ""
