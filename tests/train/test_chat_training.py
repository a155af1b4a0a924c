"""Issue 38: training on chat data. float64, prepared Llama-3-style chat records (their prompt tokens
-100), packed (`pack`): the step's loss and gradients at DP 2 with one-row micro-batches, whose
target counts differ, equal one rank's with the whole batch (loss 1e-12, gradients 1e-10), and so
does the validation loss (the sum over its targets / their count); the step hands each
micro-batch's document ids to the model's forward (`documents=`, contract 2; the model is
wrapped here to take them where this build's does not; unpacked masked batches:
tests/train/test_loss_average.py); --sample-every's prompt is
the chat template's. With a model that keeps attention inside documents, a packed batch's loss
equals each document's summed target losses computed alone, over the total target count."""
import io

import inspect

import numpy as np
import pytest

from tests.mpirun import run_mpi
from tests.tp_utils import on_rank_0

pytest.importorskip("tokenizers", reason="the tokenizers library is not installed (pip install tokenizers)")
pytest.importorskip("jinja2", reason="jinja2 is not installed (pip install jinja2): chat templates are Jinja")

IGNORE = -100


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    from cutp.data.prepare import RecordSettings, prepare
    from tests.data.chat_templates import CONVERSATIONS, chat_tokenizer, write_jsonl

    root = tmp_path_factory.mktemp("chat_training")
    tok = chat_tokenizer(str(root / "tok"), "llama3")
    src = write_jsonl(root / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS] * 12)
    prepare([src], tok, str(root / "data"), val_fraction=0.25, workers=1, stream=io.StringIO(),
            records=RecordSettings("chat", max_seq_len=96))
    return str(root / "data")


def _config(data, dp=1, micro=8, pack=False, **kw):
    from cutp.data import load_dataset
    from cutp.models import GPTConfig
    from cutp.train import RunConfig

    vocab = load_dataset(data).vocab_size
    model = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=vocab, block_size=96, dtype="float64",
                      vocab_multiple=1)
    settings = dict(model=model, dp=dp, batch_size=8, micro_batch_size=micro, seq_len=96 if pack else 40, steps=3,
                    warmup=1, seed=2, eval_every=0, eval_batches=1, quiet=True, save_on_signal=False, data=data,
                    pack=pack)
    return RunConfig(**{**settings, **kw})


def _takes_documents(model_class) -> bool:
    return all("documents" in inspect.signature(getattr(model_class, f)).parameters
               for f in ("forward", "stage_forward"))


def _model_takes_documents():
    """GPT.forward (recording them) and stage_forward wrapped to take documents= where this build's do not."""
    from cutp.models import GPT

    if _takes_documents(GPT):
        return None
    plain, plain_stage, seen = GPT.forward, GPT.stage_forward, []

    def forward(self, idx, targets=None, check=True, *, documents=None):
        seen.append(None if documents is None else np.asarray(documents))
        return plain(self, idx, targets, check)

    def stage_forward(self, *args, documents=None, **kw):
        return plain_stage(self, *args, **kw)

    GPT.forward, GPT.stage_forward = forward, stage_forward
    return seen


def _train(cfg, comm):
    from cutp.train import build_run, evaluate, train_step

    run = build_run(cfg, comm)
    counts = [int((y != IGNORE).sum()) for _, y in run.sampler.micro_batches(0)]
    docs = [b.documents for b in run.sampler.micro_batches(0)]
    losses = [train_step(run).loss]
    grads = {p.name: p.grad.copy() for p in run.model.parameters()}
    val = evaluate(run)
    run.close()
    return losses, grads, val, counts, docs


# every layout matches one rank (checked on demand: _worker(data, LAYOUTS)); the suite runs DP 2's
LAYOUTS = [dict(dp=2, micro=1), dict(dp=1, tp=2, sequence_parallel=True, micro=2),
           dict(dp=1, cp=2, cp_comm="ring", micro=2), dict(dp=1, cp=2, cp_comm="a2a", micro=4), dict(dp=1, pp=2, micro=2)]


def _worker(data, layouts):
    from mpi4py import MPI

    seen = _model_takes_documents()
    ref_losses, ref_grads, ref_val, _, _ = on_rank_0(lambda: _train(_config(data, dp=1, micro=8, pack=True),
                                                                    MPI.COMM_SELF))
    for layout in layouts:
        if seen is not None:
            seen.clear()
        losses, grads, val, counts, docs = _train(_config(data, pack=True, **layout), MPI.COMM_WORLD)
        if seen is not None and layout["dp"] == 2:  # the step's forwards got the sampler's ids (and the evaluation's)
            assert len(seen) == 4 + 4 and all(d is not None for d in seen)
            for got, want in zip(seen[:4], docs):
                np.testing.assert_array_equal(got, want)
            assert len(set(counts)) > 1  # micro-batches of different target counts: the weighting matters
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-12, atol=0, err_msg=str(layout))
        np.testing.assert_allclose(val, ref_val, rtol=1e-12, atol=0, err_msg=str(layout))
        for name, g in ref_grads.items():
            if name in grads and grads[name].shape == g.shape:  # (tp 2: the replicated ones; pp 2: the stage's)
                assert float(np.abs(grads[name] - g).max()) <= 1e-10 * float(np.abs(g).max()), (layout, name)


def test_masked_loss_and_gradients_at_dp2_equal_one_rank(chat_data):
    run_mpi(2, "tests.train.test_chat_training:_worker", chat_data, LAYOUTS[:1], timeout=180)


def test_the_validation_loss_is_the_mean_over_the_masked_targets(chat_data):
    from mpi4py import MPI

    from cutp.train import build_run, evaluate

    run = build_run(_config(chat_data, dp=1, micro=4, eval_batches=2), MPI.COMM_SELF)
    total = count = 0.0
    for i in range(2):
        x, y = (np.concatenate(a) for a in zip(*run.sampler.micro_batches(i, "val")))
        run.model.eval()
        n = int((y != IGNORE).sum())
        total += float(run.model.forward(x, y)) * n
        count += n
    assert 0 < count < y.size * 2 and abs(evaluate(run) - total / count) <= 1e-12 * total / count
    run.close()


def test_sample_every_templates_the_prompt_and_stops_at_the_end_of_turn(chat_data):
    from mpi4py import MPI

    from cutp.data.chat import ChatTemplate
    from cutp.data.tokenizer import load_tokenizer
    from cutp.train import PromptSampler, build_run

    run = build_run(_config(chat_data, dp=1, micro=8, sample_every=1, sample_prompt="Hi", sample_tokens=4),
                    MPI.COMM_SELF)
    sampler = PromptSampler.for_run(run)
    tok_dir = run.dataset.tokenizer["path"]
    tok = load_tokenizer(tok_dir)
    assert sampler.chat and sampler.ids == ChatTemplate.from_dir(tok_dir).prompt_ids(tok, "Hi")
    assert tok.decode(sampler.ids).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert sampler.stop == tok.tokenizer.token_to_id("<|eot_id|>")
    assert isinstance(sampler.sample(run), str)
    run.close()


def test_a_packed_batch_is_each_document_alone():
    """Runs where the model takes documents= (contract 2); skipped in a build without it."""
    from cutp.models import GPT

    if not _takes_documents(GPT):
        pytest.skip("GPT.forward has no documents= in this build (the attention paths' part of issue 38)")
    import cutp
    from mpi4py import MPI

    from cutp.data.packing import PackedSplit
    from cutp.models import GPTConfig

    rng = np.random.default_rng(0)
    lengths = np.array([5, 9, 3, 12, 7, 1, 8])
    tokens = rng.integers(0, 50, lengths.sum())
    masks = (rng.random(lengths.sum()) < 0.7).astype(np.uint8)
    packed = PackedSplit(lengths, 16, "train")
    rows = [packed.row(tokens, masks, w) for w in range(len(packed))]
    x, y, docs = (np.stack(r) for r in zip(*rows))
    ctx = cutp.init(comm=MPI.COMM_SELF)
    model = GPT(ctx, GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=50, block_size=16, dtype="float64",
                               vocab_multiple=1), seed=1)
    model.eval()
    loss = float(model.forward(x, y, documents=docs))
    total, count = 0.0, 0
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for a, b in zip(starts[:-1], starts[1:]):
        t = tokens[a:b][None]
        target = np.where(masks[a + 1:b] == 1, tokens[a + 1:b], IGNORE)[None]
        n = int((target != IGNORE).sum())
        if b - a > 1 and n:
            total += float(model.forward(t[:, :-1], target)) * n
            count += n
    assert abs(loss - total / count) <= 1e-12 * abs(loss)
    ctx.close()


def test_generate_script_chat_templates_the_prompt_and_stops_at_the_end_of_turn(tmp_path, capsys):
    from cutp.data.chat import ChatTemplate
    from cutp.data.tokenizer import load_tokenizer
    from cutp.generate import generate
    from cutp.hf import from_hf_gpt2, save_hf_gpt2
    from tests.acceptance.test_hugging_face_user import _load_example, _random_model
    from tests.data.chat_templates import chat_tokenizer
    from tests.tp_utils import self_ctx

    d = chat_tokenizer(str(tmp_path / "m"), "llama3")
    tok, template = load_tokenizer(d), ChatTemplate.from_dir(d)
    eot = tok.tokenizer.token_to_id("<|eot_id|>")
    ctx = self_ctx()
    model = _random_model(ctx, vocab_size=tok.vocab_size, tie_embeddings=False, block_size=64)
    prompt = template.prompt_ids(tok, "Hi there")
    head = model.gather_state_dict()["lm_head.weight"]
    head[eot] = 1.5 * head[generate(model, prompt, 3, temperature=0)[2]]  # <|eot_id|> the argmax by the third
    model.load_full_state_dict({"lm_head.weight": head}, strict=False)
    save_hf_gpt2(model, d)
    greedy = generate(from_hf_gpt2(ctx, d, dtype="float64"), prompt, 6, temperature=0)
    assert eot in greedy[1:] and greedy.index(eot) < 5, greedy
    _load_example("generate.py").main(["--ckpt", d, "--device", "cpu", "--chat", "--prompt", "Hi there",
                                       "--temperature", "0", "--print-ids", "--max-new-tokens", "6", "--dtype",
                                       "float64"])
    text, ids = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    new = greedy[:greedy.index(eot) + 1]
    assert [int(i) for i in ids[len("ids:"):].split(",")] == new and text == tok.decode(new[:-1])
