"""Sample text from a Hugging Face model directory (GPT-2, Llama, Qwen2, Mistral, Mixtral) or a cutp
checkpoint of any family, tensor-parallel.

    python examples/generate.py --ckpt DIR --prompt "Hello" --max-new-tokens 50
    mpiexec -n 2 python examples/generate.py --ckpt DIR --tp 2 --prompt-ids 1,2,3 --temperature 0

DIR is either a Hugging Face directory (config.json with its model_type + model.safetensors or sharded
weights, and optionally tokenizer.json or vocab.json + merges.txt for text prompts) or a cutp
checkpoint (a directory with meta.json, or a run directory with `latest` / step-*; loaded,
resharded to --tp, by cutp.checkpoint.load_model). The tokenizer (cutp.data.tokenizer, the
`tokenizers` library's; the one prepare-data uses) is --tokenizer DIR|bytes, else DIR's tokenizer
files; without them, a 256-token model uses the byte tokenizer; any other model needs
--prompt-ids, and the output is printed as ids. A text prompt starts with BOS where the
tokenizer's template adds one (Llama's), as transformers encodes it.

--chat applies the tokenizer directory's chat template (its tokenizer_config.json or
chat_template.jinja, rendered as transformers' apply_chat_template renders it: cutp.data.chat) to
the prompt, a one-turn conversation ending in the generation prompt, and stops at the template's
end-of-turn token (Llama 3's <|eot_id|>, Qwen's <|im_end|>, Gemma's <end_of_turn>); rank 0 then
prints the assistant's reply alone.

--temperature 0 is greedy decoding (argmax; --top-k and --seed then change nothing).
Generation stops after the tokenizer's EOS (GPT-2's <|endoftext|>, id 50256) when the
tokenizer has one, kept in the output; --stop-token ID stops at another id, --no-stop
always generates --max-new-tokens. Rank 0 prints the prompt followed by its continuation
(with --print-ids, also the new ids, on a line starting "ids:"). Every rank generates the
same tokens (see cutp.generate).
"""
from __future__ import annotations

import argparse
import os
import sys

try:
    import cutp  # noqa: F401
except ImportError:  # run from a checkout without installing: python examples/generate.py
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import cutp  # noqa: F401

from mpi4py import MPI

from cutp.checkpoint import load_model
from cutp.checkpoint.files import is_cutp_checkpoint
from cutp.generate import check_request, generate
from cutp.hf import from_hf
from cutp.runtime.failure import config_errors_exit, errors_raised_on_every_rank
from cutp.data.chat import ChatTemplate
from cutp.data.tokenizer import BYTES, MERGES_FILE, TOKENIZER_FILE, VOCAB_FILE, get_tokenizer, has_tokenizer_files


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="Hugging Face GPT-2 directory or cutp checkpoint directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--tokenizer", default=None, help="a directory with tokenizer.json, or 'bytes' "
                   "(default: --ckpt's tokenizer files)")
    p.add_argument("--chat", action="store_true", help="the prompt is a user's message: rendered with the tokenizer's "
                   "chat template, generation stopped at its end-of-turn token")
    p.add_argument("--system", default=None, help="--chat: a system message before the prompt")
    p.add_argument("--max-new-tokens", type=int, default=50)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (argmax)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: all ranks)")
    p.add_argument("--pp", type=int, default=1, help="generation runs without pipeline stages: a checkpoint of "
                   "any PP size loads at pp 1 (TP over the ranks); --pp > 1 says so and does that")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32", help="for Hugging Face weights")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--stop-token", type=int, default=None,
                      help="stop after this token id (default: the tokenizer's EOS, if any)")
    stop.add_argument("--no-stop", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--print-ids", action="store_true", help="also print the generated ids")
    return p.parse_args(argv)


def check_args(args) -> list | None:
    """The checks of the arguments alone, before any work (ConfigError, one line); returns the
    --prompt-ids as a list (None for a text prompt). Raised under errors_raised_on_every_rank, so
    the line is printed once, not by every rank (argparse's error was, with its usage block)."""
    if not args.temperature >= 0:
        raise cutp.ConfigError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.chat and args.prompt is None:
        raise cutp.ConfigError("--chat needs a text --prompt (the user's message)")
    if args.max_new_tokens < 0:
        raise cutp.ConfigError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.top_k is not None and args.top_k < 1:
        raise cutp.ConfigError(f"--top-k must be >= 1 (the tokens sampled from), got {args.top_k}; omit it to "
                               "sample from every token")
    # a --tokenizer given is used or refused, never silently replaced by the byte tokenizer
    if args.tokenizer not in (None, BYTES) and not (has_tokenizer_files(args.tokenizer)
                                                    or os.path.isfile(args.tokenizer)):
        raise cutp.ConfigError(f"--tokenizer {args.tokenizer}: no such directory with {TOKENIZER_FILE} (or "
                               f"{VOCAB_FILE} + {MERGES_FILE}); give one, or {BYTES!r} for the byte tokenizer")
    if args.prompt_ids is None:
        return None
    try:
        return [int(t) for t in args.prompt_ids.replace(" ", "").split(",") if t]
    except ValueError:
        raise cutp.ConfigError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None


def check_prompt(prompt: list, args, config) -> None:
    """The prompt against the model: non-empty, its ids in the vocabulary, it and the new tokens
    within block_size (cutp.generate's ValueError, a traceback from the script before)."""
    what = "--prompt-ids" if args.prompt is None else "--prompt"
    if not prompt:
        raise cutp.ConfigError(f"{what} holds no token; give a prompt of at least one")
    outside = [t for t in prompt if not 0 <= t < config.vocab_size]
    if outside:
        raise cutp.ConfigError(f"{what}: token id {outside[0]} is outside the model's vocabulary [0, "
                               f"{config.vocab_size}); use ids below {config.vocab_size}")
    try:
        check_request(config, len(prompt), args.max_new_tokens)
    except ValueError as e:
        raise cutp.ConfigError(str(e).replace("max_new_tokens", "--max-new-tokens")) from None


def load(ckpt: str, ctx, dtype: str):
    """The model (a cutp checkpoint resharded to ctx's TP size, or Hugging Face weights in `dtype`)."""
    if is_cutp_checkpoint(ckpt):
        model, _meta = load_model(ckpt, ctx)
        return model
    return from_hf(ctx, ckpt, dtype=dtype)  # by config.json's model_type


def shown_text(tok, prompt: list, new: list) -> str:
    """The prompt and its continuation as text, without the BOS the tokenizer's template put first
    (a model's input, not the user's text)."""
    bos = getattr(tok, "bos_id", None)
    return tok.decode((prompt[1:] if prompt and bos is not None and prompt[0] == bos else prompt) + new)


def main(argv=None):
    args = parse_args(argv)
    with errors_raised_on_every_rank(MPI.COMM_WORLD):  # one line, before any work
        prompt = check_args(args)
    world = MPI.COMM_WORLD.Get_size()
    ctx = cutp.init(tp=args.tp or world, device=args.device)
    if args.pp > 1 and ctx.rank == 0:
        print(f"note: --pp {args.pp}: generation runs the whole model on every TP group, without pipeline "
              f"stages; the checkpoint is loaded at pp 1, tp {ctx.tp_size} (its stages' files read and resharded)",
              file=sys.stderr, flush=True)
    model = load(args.ckpt, ctx, args.dtype)
    V = model.config.vocab_size
    with errors_raised_on_every_rank(ctx.world.mpi_comm):  # one line, every rank alike
        try:
            tok = get_tokenizer(args.tokenizer or args.ckpt, V)
        except cutp.ConfigError as e:
            if args.prompt is not None:
                raise
            tok, why = None, e
    end_of_turn = None
    if args.chat:
        with errors_raised_on_every_rank(ctx.world.mpi_comm):  # one line, every rank alike
            template = ChatTemplate.from_dir(args.tokenizer or args.ckpt)
            prompt, end_of_turn = template.prompt_ids(tok, args.prompt, args.system), template.end_of_turn(tok)
    elif args.prompt is not None:
        prompt = tok.encode(args.prompt)
    stop = None if args.no_stop else args.stop_token if args.stop_token is not None else \
        end_of_turn if end_of_turn is not None else getattr(tok, "eos_id", None)
    with errors_raised_on_every_rank(ctx.world.mpi_comm):  # one line, every rank alike
        check_prompt(prompt, args, model.config)
        if stop is not None and not 0 <= stop < V:
            raise cutp.ConfigError(f"--stop-token {stop} is outside the model's vocabulary [0, {V}); "
                                   f"use an id below {V} or --no-stop")
    new = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   seed=args.seed, stop_token=stop)
    if ctx.rank == 0:
        if args.chat:
            print(tok.decode(new[:-1] if new and new[-1] == stop else new), flush=True)
        elif tok is not None:
            print(shown_text(tok, prompt, new), flush=True)
        else:
            print(f"(printing token ids: {why})", file=sys.stderr)
            print(",".join(map(str, prompt + new)), flush=True)
        if args.print_ids:
            print("ids:" + ",".join(map(str, new)), flush=True)
    ctx.close()


if __name__ == "__main__":
    with config_errors_exit("generate.py"):  # a checkpoint or setting that cannot run: one line, exit 2
        main()
