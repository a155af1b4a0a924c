"""Supervised fine-tuning on chat data, end to end and offline (docs/fine-tuning.md's worked example).

    python examples/chat_sft.py --out /tmp/chat-sft            # tokenizer, chat set, SFT at tp 2, export
    python examples/chat_sft.py --out DIR --ranks 1 --steps 60  # smaller

1. A byte-level BPE tokenizer trained with the `tokenizers` trainer on the embedded corpus (the
   Python standard library's sources), with Llama 3's special tokens and chat template in its
   tokenizer_config.json (DIR/tokenizer).
2. A chat set made from the same corpus: each record asks which line follows a line of a source
   file, and the assistant answers with it (DIR/chat.jsonl, --records of them).
3. `python -m cutp prepare-data --format chat` (assistant-only targets, --max-seq-len the
   training's sequence length) into DIR/data.
4. llama-tiny (its vocabulary the tokenizer's) trained whole at --ranks ranks of TP (2 by default)
   from scratch for --base-steps (packed: --pack): the base (DIR/base).
5. LoRA SFT of that base (--lora-rank R on q, k, v, o, gate, up, down; the base frozen) for --steps,
   the masked validation loss printed every --eval-every steps and a sample of the chat template's
   reply (DIR/run; --lora-rank 0: the base trained whole instead).
6. `python -m cutp export-hf` of the run with its tokenizer and template (DIR/hf: the base, and the
   adapter in PEFT's format in DIR/hf/adapter); with peft installed, the adapter is loaded onto the
   exported base and its logits compared with the merged export's.

Needs `tokenizers` and `jinja2`; the training runs under the mpiexec beside this Python.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from cutp.data import default_corpus  # noqa: E402
from cutp.data.prepare import RecordSettings, prepare  # noqa: E402

# after the trained tokens, in this order: BOS is vocab_size - 5, <|eot_id|> (the model's EOS) vocab_size - 1
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
                   "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
                   "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
                   "{{ content }}{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def corpus_lines(max_bytes: int = 2 << 20) -> list:
    text = bytes(default_corpus(max_bytes=max_bytes).train[:max_bytes]).decode("utf-8", "replace")
    return text.splitlines()


def train_tokenizer(directory: str, lines: list, vocab_size: int) -> str:
    """Byte-level BPE with Llama 3's special tokens after the trained ones, and its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIALS), show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(SPECIALS)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0], "eos_token": "<|eot_id|>",
              "chat_template": LLAMA3_TEMPLATE, "model_max_length": 256}
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    return directory


def chat_records(lines: list, n: int, seed: int = 0) -> list:
    """n records: "Which line follows `<line>`?" answered with the next non-empty line."""
    rng = random.Random(seed)
    pairs = [(a.strip(), b.strip()) for a, b in zip(lines, lines[1:]) if 8 < len(a.strip()) < 70
             and 3 < len(b.strip()) < 70]
    records = []
    for a, b in rng.sample(pairs, n):
        records.append({"messages": [
            {"role": "system", "content": "You complete Python source code."},
            {"role": "user", "content": f"Which line follows `{a}`?"},
            {"role": "assistant", "content": b}]})
    return records


def compare_with_peft(hf: str, merged: str, vocab_size: int) -> None:
    """The PEFT adapter loaded onto the exported base gives the merged export's logits (skipped,
    saying so, without torch, transformers and peft)."""
    try:
        import torch
        import transformers.utils as hf_utils
        import transformers.utils.import_utils as hf_import_utils

        # (transformers looks for the hub's `kernels` package by name: from this checkout's root that
        # name is cutp's kernels/ directory; told it is absent, it runs its own PyTorch code)
        os.environ.setdefault("USE_HUB_KERNELS", "NO")
        hf_import_utils.is_kernels_available = hf_utils.is_kernels_available = lambda *_a, **_k: False
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        print(f"peft check skipped: {e}")
        return
    ids = torch.randint(0, vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        got = PeftModel.from_pretrained(base, os.path.join(hf, "adapter")).eval()(ids).logits
        want = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(ids).logits
    print(f"peft: the adapter on the exported base gives the merged export's logits within "
          f"{float((got - want).abs().max() / want.abs().max()):.1e} (relative)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="a new directory for the tokenizer, data, run and export")
    p.add_argument("--records", type=int, default=600)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--ranks", type=int, default=2, help="TP size of the training (default 2)")
    p.add_argument("--base-steps", type=int, default=100, help="the base model's full training first")
    p.add_argument("--steps", type=int, default=150, help="then the LoRA SFT's")
    p.add_argument("--lora-rank", type=int, default=8, help="the adapters' rank (0: train the base whole instead)")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args(argv)
    if os.path.exists(args.out):
        p.error(f"--out {args.out} exists; give a new directory")
    lines = corpus_lines()
    tok_dir = train_tokenizer(os.path.join(args.out, "tokenizer"), lines, args.vocab_size)
    chat = os.path.join(args.out, "chat.jsonl")
    with open(chat, "w", encoding="utf-8") as f:
        for r in chat_records(lines, args.records):
            f.write(json.dumps(r) + "\n")
    data = os.path.join(args.out, "data")
    prepare([chat], tok_dir, data, val_fraction=0.1, workers=1,
            records=RecordSettings("chat", max_seq_len=args.seq_len))
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = mpiexec if os.path.exists(mpiexec) else shutil.which("mpiexec") or "mpiexec"
    base, run = os.path.join(args.out, "base"), os.path.join(args.out, "run")
    metrics = os.path.join(args.out, "metrics.jsonl")
    common = ["--tp", str(args.ranks), "--data", data, "--seq-len", str(args.seq_len), "--pack", "--batch-size", "16",
              "--eval-every", str(args.eval_every), "--eval-batches", "4", "--log-every", str(args.eval_every)]

    def train(*flags):
        subprocess.run([mpiexec, "-n", str(args.ranks), sys.executable, os.path.join(HERE, "train_gpt.py"), *common,
                        *flags], check=True, cwd=ROOT)

    train("--preset", "llama-tiny", "--set", f"vocab_size={args.vocab_size}", "--set", f"block_size={args.seq_len}",
          "--set", f"bos_token_id={args.vocab_size - len(SPECIALS)}", "--set", f"eos_token_id={args.vocab_size - 1}",
          "--steps", str(args.base_steps), "--lr", "3e-3", "--out", base)
    lora = ["--lora-rank", str(args.lora_rank), "--lora-alpha", str(2 * args.lora_rank), "--lora-targets",
            "q,k,v,o,gate,up,down"] if args.lora_rank else []
    train("--init-from", base, *lora, "--steps", str(args.steps), "--lr", "3e-3", "--sample-every", str(args.steps),
          "--sample-prompt", "Which line follows `import os`?", "--out", run, "--metrics", metrics)
    hf = os.path.join(args.out, "hf")
    subprocess.run([sys.executable, "-m", "cutp", "export-hf", run, "--out", hf], check=True, cwd=ROOT)
    if args.lora_rank:
        subprocess.run([sys.executable, "-m", "cutp", "export-hf", run, "--out", hf + "-merged", "--merge-lora"],
                       check=True, cwd=ROOT)
        compare_with_peft(hf, hf + "-merged", args.vocab_size)
    with open(metrics, encoding="utf-8") as f:
        val = [(r["step"], r["val_loss"]) for r in map(json.loads, f) if "val_loss" in r]
    print("masked validation loss: " + ", ".join(f"step {s}: {v:.3f}" for s, v in val))
    return 0


if __name__ == "__main__":
    sys.exit(main())
