"""`python -m cutp bench compare-torch`: cutp against PyTorch eager on the CPU, same model, same
weights, same batch, same thread count.

GPT-2 presets: the PyTorch model is a plain nanoGPT-style GPT-2 (pre-LN blocks, tanh GeLU, tied
embedding, ``F.scaled_dot_product_attention`` with ``is_causal=True`` as nanoGPT uses it, or the
explicit masked softmax with ``--torch-attention manual``) in float32, loaded with cutp's exact
weights (``model.gather_state_dict()``: GPT-2 names, Conv1D [in, out] layout, transposed into
``nn.Linear``'s [out, in]).

Llama-family presets (RMSNorm, RoPE, SwiGLU, GQA, untied; ``llama-tiny``, ``llama-gpt2``): a
plain torch module of the same math under transformers' names and layouts (cutp's weights through
``cutp.models.hf.hf_state_dict``): RMSNorm in float32, ``rotate_half`` RoPE, SDPA with
``is_causal=True`` and ``enable_gqa=True`` (or the masked softmax with ``--torch-attention
manual``), ``down(silu(gate(x)) * up(x))``. That module is always the one timed. Where
transformers is installed, its ``LlamaForCausalLM`` with the same weights checks the module's
loss and gradients first (transformers is never timed: its dispatch layers are not the eager
baseline the issue compares against).

Before any timing the two must agree on the loss and on a few gradients, so that the comparison
is of the same work. Then forward+backward of both run interleaved, repeat after repeat, and the
ratio of the medians cutp/torch is printed (< 1: cutp is faster).

After the timed repeats, more steps of each are profiled (``--profile-repeats``, kept out of the
timed medians): cutp's under `cutp.ops.profile.OpTimer`, torch's GEMMs (``aten.mm`` /
``aten.addmm``: the linear layers') timed in a dispatch mode. Both spend most of a step in the
same GEMMs of the same shapes, so cutp's GEMM time over torch's whole step is the ratio cutp
would reach with nothing but its GEMMs: the floor below which only faster GEMMs take it.

torch is an optional extra (``pip install torch``): it is imported only here.

(It runs over 500 lines on purpose: the two plain torch modules are part of what is compared,
read here beside the checks that prove they do cutp's math and the timing that uses them.)
"""
from __future__ import annotations

import contextlib
import math
import os
import sys
import time

import numpy as np

import cutp

from ..models import GPT, GPTConfig
from ..models.hf import config_to_hf, hf_state_dict
from .. import ops
from ..models.names import from_gpt2, to_gpt2
from ..ops.profile import OP_KINDS, OpTimer
from ..runtime.errors import ConfigError
from ..runtime.threads import get_blas_threads, keep_freed_host_memory, set_blas_threads
from ..train.reporting import Report
from .common import Timing, machine_info

DEFAULT_SHAPES = {"tiny": (16, 128), "gpt2": (4, 256), "llama-tiny": (16, 128), "llama-gpt2": (4, 256)}


def torch_missing_reason() -> str | None:
    """None when torch imports; else why not (the compare-torch suite is skipped)."""
    try:
        import torch  # noqa: F401 (optional dependency)
    except Exception as e:  # ImportError, or a broken install
        return (f"torch is not importable ({type(e).__name__}: {e}); it is an optional extra: "
                "pip install torch (a CPU build is enough)")
    return None


def lacks(config) -> str | None:
    """None when one of the two torch modules computes `config`'s math; else what the module its
    family would use leaves out, named by cutp's fields. (Without this, a Qwen3 was compared to a
    Llama module without its q/k norms, and the disagreement read as a bug in cutp.)"""
    c = config
    missing = [what for cond, what in (
        (c.n_experts, "experts (n_experts)"), (c.kv_lora_rank or c.q_lora_rank, "latent attention (kv_lora_rank)"),
        (c.qk_norm, "q/k norms (qk_norm)"),
        (c.sliding_window is not None or c.layer_types is not None, "sliding-window layers (sliding_window)"),
        (c.attn_softcap or c.final_softcap, "softcaps (attn_softcap, final_softcap)"),
        (c.norm_offset, "1 + weight norms (norm_offset)"), (c.embed_scale, "a scaled embedding (embed_scale)"),
        (c.post_norms, "post-norms (post_norms)"), (c.query_pre_attn_scalar is not None, "query_pre_attn_scalar"),
        (c.dropout, "dropout"), (c.label_smoothing, "label smoothing")) if cond]
    if is_llama(c):
        module = "the Llama module (RMSNorm, RoPE, SwiGLU, GQA, untied, no biases)"
        biases = [b if b is not None else c.bias for b in (c.qkv_bias, c.attn_out_bias, c.mlp_bias)]
        missing += [what for cond, what in ((c.rope_scaling != "none", f"RoPE scaling (rope_scaling={c.rope_scaling})"),
                                            (c.tie_embeddings, "tied embeddings (tie_embeddings)"),
                                            (any(biases), "biases (bias, qkv_bias, ...)")) if cond]
    else:
        module = "the GPT-2 module (LayerNorm, learned positions, tanh GeLU, MHA, tied embeddings)"
        missing += [what for cond, what in (
            (c.norm != "layernorm", f"{c.norm} (norm)"), (c.positions != "learned", f"{c.positions} positions"),
            (c.mlp != "gelu", f"{c.mlp} MLP (mlp)"), (c.gelu != "tanh", f"{c.gelu} GeLU (gelu)"),
            (c.kv_heads != c.n_head, "grouped-query attention (n_kv_head)"),
            (not c.tie_embeddings, "untied embeddings (tie_embeddings)"),
            (c.head_dim not in (None, c.n_embd // c.n_head), "head_dim"),
            (any(b is not None and b != c.bias for b in (c.qkv_bias, c.attn_out_bias, c.mlp_bias)),
             "per-layer biases (qkv_bias, ...)")) if cond]
    return f"{module} has no {', '.join(missing)}" if missing else None


def check_presets(presets, overrides=()) -> None:
    """Before any work: ConfigError naming the first preset (with `overrides`) that neither torch
    module computes, and what its module lacks."""
    for preset in presets:
        why = lacks(GPTConfig.preset(preset, dtype="float32").with_overrides(overrides))
        if why:
            raise ConfigError(f"compare-torch cannot compare {preset}: {why}; compare a preset it implements "
                              "(tiny, gpt2, llama-tiny, llama-gpt2, llama3-8b, mistral-7b, ...)")


def build_torch_gpt(config, state: dict, attention: str = "sdpa"):
    """A nanoGPT-style torch.nn.Module with cutp's weights (GPT-2 names, Conv1D layout)."""
    import torch  # optional dependency
    import torch.nn as nn  # optional dependency
    import torch.nn.functional as F  # optional dependency

    c = config
    if c.kv_heads != c.n_head or not c.tie_embeddings or c.gelu != "tanh":
        raise ValueError("compare-torch supports GPT-2 configurations (MHA, tied embeddings, tanh GeLU)")
    h, nh = c.n_embd, c.n_head

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(h, 3 * h, bias=c.bias)
            self.c_proj = nn.Linear(h, h, bias=c.bias)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.c_attn(x).split(h, dim=2)
            q = q.view(B, T, nh, C // nh).transpose(1, 2)
            k = k.view(B, T, nh, C // nh).transpose(1, 2)
            v = v.view(B, T, nh, C // nh).transpose(1, 2)
            if attention == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
                mask = torch.ones(T, T, dtype=torch.bool).triu(1)
                att = att.masked_fill(mask, float("-inf"))
                y = F.softmax(att, dim=-1) @ v
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.c_proj(y)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(h, c.hidden, bias=c.bias)
            self.c_proj = nn.Linear(c.hidden, h, bias=c.bias)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(h, eps=c.norm_eps, bias=c.bias)
            self.attn = Attention()
            self.ln_2 = nn.LayerNorm(h, eps=c.norm_eps, bias=c.bias)
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(c.vocab_size, h)
            self.wpe = nn.Embedding(c.block_size, h)
            self.h = nn.ModuleList([Block() for _ in range(c.n_layer)])
            self.ln_f = nn.LayerNorm(h, eps=c.norm_eps, bias=c.bias)

        def forward(self, idx, targets):
            T = idx.shape[1]
            x = self.wte(idx) + self.wpe(torch.arange(T))
            for block in self.h:
                x = block(x)
            logits = F.linear(self.ln_f(x), self.wte.weight)  # tied LM head
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    model = GPT()
    with torch.no_grad():
        for name, p in model.named_parameters():
            a = state[from_gpt2(name)]  # (the torch model keeps GPT-2's names)
            if name.endswith(".weight") and p.ndim == 2 and not name.startswith(("wte", "wpe")):
                a = a.T  # Conv1D [in, out] -> nn.Linear [out, in]
            if tuple(a.shape) != tuple(p.shape):
                raise ValueError(f"{name}: cutp shape {a.shape} does not fit torch shape {tuple(p.shape)}")
            p.copy_(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)))
    return model


@contextlib.contextmanager
def hub_kernels_visible():
    """Run from a checkout's root, its top-level ``kernels/`` (cutp.kernels' sources) would shadow
    the Hub's ``kernels`` package that transformers imports: the checkout's root is left off
    sys.path while transformers loads."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(cutp.__file__)))
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != root]
    try:
        yield
    finally:
        sys.path[:] = saved


def transformers_missing_reason() -> str | None:
    """None when transformers' LlamaForCausalLM imports; else why not (its check is skipped)."""
    try:
        with hub_kernels_visible():
            from transformers import LlamaForCausalLM  # noqa: F401 (optional dependency)
    except Exception as e:  # ImportError, or a broken install
        return f"transformers is not importable ({type(e).__name__}: {e}): pip install transformers"
    return None


def is_llama(config) -> bool:
    return config.norm == "rmsnorm" and config.positions == "rope" and config.mlp == "swiglu"


def build_torch_llama(config, hf_state: dict, attention: str = "sdpa"):
    """A plain torch.nn.Module of the Llama family's math under transformers' names and layouts,
    loaded from `hf_state` ({HF key: array}, `hf_state_dict`)."""
    import torch  # optional dependency
    import torch.nn as nn  # optional dependency
    import torch.nn.functional as F  # optional dependency

    c = config
    if c.n_experts or c.rope_scaling != "none" or c.tie_embeddings or c.qkv_bias or c.mlp_bias or c.attn_out_bias:
        raise ValueError("compare-torch supports dense, untied Llama configurations without biases or RoPE scaling")
    h, nh, nkv, hd, F_ = c.n_embd, c.n_head, c.kv_heads, c.head_size, c.hidden

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(h))

        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.norm_eps))

    def rotate_half(x):
        return torch.cat((-x[..., hd // 2:], x[..., :hd // 2]), dim=-1)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(h, nh * hd, bias=False)
            self.k_proj = nn.Linear(h, nkv * hd, bias=False)
            self.v_proj = nn.Linear(h, nkv * hd, bias=False)
            self.o_proj = nn.Linear(nh * hd, h, bias=False)

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            q = self.q_proj(x).view(B, T, nh, hd).transpose(1, 2)
            k = self.k_proj(x).view(B, T, nkv, hd).transpose(1, 2)
            v = self.v_proj(x).view(B, T, nkv, hd).transpose(1, 2)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            if attention == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nh)
            else:
                k, v = (a.repeat_interleave(nh // nkv, dim=1) for a in (k, v))
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
                att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
                y = F.softmax(att, dim=-1) @ v
            return self.o_proj(y.transpose(1, 2).reshape(B, T, nh * hd))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(h, F_, bias=False)
            self.up_proj = nn.Linear(h, F_, bias=False)
            self.down_proj = nn.Linear(F_, h, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = RMSNorm()
            self.self_attn = Attention()
            self.post_attention_layernorm = RMSNorm()
            self.mlp = MLP()

        def forward(self, x, cos, sin):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin)
            return x + self.mlp(self.post_attention_layernorm(x))

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(c.vocab_size, h)
            self.layers = nn.ModuleList([Layer() for _ in range(c.n_layer)])
            self.norm = RMSNorm()

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Body()
            self.lm_head = nn.Linear(h, c.vocab_size, bias=False)
            inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
            freqs = torch.outer(torch.arange(c.block_size).float(), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.register_buffer("cos", emb.cos(), persistent=False)
            self.register_buffer("sin", emb.sin(), persistent=False)

        def forward(self, idx, targets):
            T = idx.shape[1]
            cos, sin = self.cos[:T], self.sin[:T]
            x = self.model.embed_tokens(idx)
            for layer in self.model.layers:
                x = layer(x, cos, sin)
            logits = self.lm_head(self.model.norm(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    model = Llama()
    _load(model, hf_state)
    return model


def _load(model, hf_state: dict):
    """Copies {HF key: array} into a torch module with those parameter names (every one needed)."""
    import torch  # optional dependency

    with torch.no_grad():
        for name, p in model.named_parameters():
            a = hf_state[name]
            if tuple(a.shape) != tuple(p.shape):
                raise ValueError(f"{name}: cutp shape {a.shape} does not fit torch shape {tuple(p.shape)}")
            p.copy_(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)))


def build_transformers_llama(config, hf_state: dict):
    """transformers' LlamaForCausalLM with the same weights (SDPA attention), float32."""
    import torch  # optional dependency

    with hub_kernels_visible():
        from transformers import LlamaConfig, LlamaForCausalLM  # optional dependency

    hf_cfg = {k: v for k, v in config_to_hf(config, "float32").items() if k not in ("architectures", "model_type")}
    model = LlamaForCausalLM(LlamaConfig(**hf_cfg, attn_implementation="sdpa")).to(torch.float32)
    _load(model, hf_state)
    return model


def torch_grad(model, name):
    """The torch gradient of cutp's parameter `name`, in cutp's layout (Conv1D [in, out])."""
    name = to_gpt2(name)
    p = dict(model.named_parameters())[name]
    g = p.grad.detach().numpy()
    if g.ndim == 2 and not name.startswith(("wte", "wpe")):
        g = g.T
    return g


CHECKED_GRADS = ("tok_embed.weight", "layers.0.attn.qkv.weight", "layers.0.mlp.fc1.bias", "final_norm.weight")
# the Llama module's: each of a layer's kinds of weight, the norms, the embedding and the head
CHECKED_LLAMA_GRADS = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                       "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                       "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
                       "model.layers.0.input_layernorm.weight", "model.norm.weight", "lm_head.weight")


def _rel(a, ref) -> float:
    return float(np.max(np.abs(a - ref)) / max(np.max(np.abs(ref)), 1e-30))


def _torch_step(tmodel, idx, targets, hf: bool = False):
    """loss (float) and {name: grad as NumPy} of one forward+backward of a torch module (hf:
    transformers' model, whose logits are taken: its own loss would shift the targets)."""
    import torch  # optional dependency
    import torch.nn.functional as F  # optional dependency

    tmodel.zero_grad(set_to_none=True)
    idx, targets = torch.from_numpy(idx), torch.from_numpy(targets)
    if hf:
        logits = tmodel(input_ids=idx).logits
        tloss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    else:
        tloss = tmodel(idx, targets)
    tloss.backward()
    return float(tloss.detach()), {n: p.grad.detach().numpy() for n, p in tmodel.named_parameters()
                                   if p.grad is not None}


def check_same_llama(model, tmodel, idx, targets, *, reference=None, rtol_loss=1e-5, rtol_grad=1e-3) -> dict:
    """`check_same_work` for the Llama module: cutp's loss and gradients (in transformers' names
    and layouts) against the module's, and, with `reference` (transformers' LlamaForCausalLM),
    the module's against it."""
    model.zero_grad()
    loss = model.forward(idx, targets)
    model.backward()
    grads = {}
    for name, p in model.named_parameters().items():
        g = model.ctx.to_numpy(p.grad)
        grads[name] = g[: p.real_rows] if p.real_rows is not None else g
    hf_grads = hf_state_dict(model.config, grads)
    tl, tgrads = _torch_step(tmodel, idx, targets)
    out = {"loss_cutp": float(loss), "loss_torch": tl, "loss_rel_diff": abs(loss - tl) / max(abs(tl), 1e-30),
           "grads": {n: _rel(hf_grads[n], tgrads[n]) for n in CHECKED_LLAMA_GRADS if n in tgrads}}
    ok = out["loss_rel_diff"] <= rtol_loss and max(out["grads"].values()) <= rtol_grad
    if reference is not None:
        hl, hgrads = _torch_step(reference, idx, targets, hf=True)
        out["transformers"] = {"loss_rel_diff": abs(hl - tl) / max(abs(hl), 1e-30),
                               "grads": {n: _rel(tgrads[n], hgrads[n]) for n in out["grads"]}}
        ok = ok and out["transformers"]["loss_rel_diff"] <= rtol_loss \
            and max(out["transformers"]["grads"].values()) <= rtol_grad
    out["ok"] = bool(ok)
    return out


def check_same_work(model, tmodel, idx, targets, *, rtol_loss=1e-5, rtol_grad=1e-3) -> dict:
    """One forward+backward of both: the losses and a few gradients must agree."""
    import torch  # optional dependency

    model.zero_grad()
    loss = model.forward(idx, targets)
    model.backward()
    tmodel.zero_grad(set_to_none=True)
    tloss = tmodel(torch.from_numpy(idx), torch.from_numpy(targets))
    tloss.backward()
    tl = float(tloss.detach())
    out = {"loss_cutp": float(loss), "loss_torch": tl, "loss_rel_diff": abs(loss - tl) / max(abs(tl), 1e-30),
           "grads": {}}
    ok = out["loss_rel_diff"] <= rtol_loss
    params = model.named_parameters()
    for name in CHECKED_GRADS:
        if name not in params:
            continue
        g = model.ctx.to_numpy(params[name].grad)
        if name == "tok_embed.weight":
            g = g[: model.config.vocab_size]
        tg = torch_grad(tmodel, name)
        rel = float(np.max(np.abs(g - tg)) / max(np.max(np.abs(tg)), 1e-30))
        out["grads"][name] = rel
        ok = ok and rel <= rtol_grad
    out["ok"] = bool(ok)
    return out


# torch's ops that are the linear layers' GEMMs (forward and both backward products); SDPA's own
# products run inside its kernel, the manual attention's in aten.bmm: not these
TORCH_GEMM_OPS = ("aten.mm", "aten.addmm")


def _profiled_split(step_cutp, step_torch, cutp_ops) -> dict:
    """One profiled step of each (outside the timed ones): {"cutp": {kind: ms, "step": ms},
    "torch": {"gemm": ms, "step": ms}}, cutp's kinds as `cutp.ops.profile.OP_KINDS`. torch's GEMMs
    are timed in a dispatch mode (every aten op then passes through Python, a cost outside its
    GEMMs' times; torch.profiler would do it too, with log lines of its own on stderr); a torch
    without it (a private module) leaves "gemm" out."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode  # optional dependency
    except ImportError:
        TorchDispatchMode = None

    with OpTimer(cutp_ops) as timer:
        t0 = time.perf_counter()
        step_cutp()
        cutp_step = time.perf_counter() - t0
    cutp_ms = {kind: s * 1e3 for kind, s in timer.seconds.items()}
    cutp_ms["step"] = cutp_step * 1e3
    if TorchDispatchMode is None:
        t0 = time.perf_counter()
        step_torch()
        return {"cutp": cutp_ms, "torch": {"step": (time.perf_counter() - t0) * 1e3}}

    class GemmTimer(TorchDispatchMode):
        seconds = 0.0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func.overloadpacket) not in TORCH_GEMM_OPS:
                return func(*args, **(kwargs or {}))
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            self.seconds += time.perf_counter() - t0
            return out

    with GemmTimer() as gemms:
        t0 = time.perf_counter()
        step_torch()
        torch_step = time.perf_counter() - t0
    return {"cutp": cutp_ms, "torch": {"gemm": gemms.seconds * 1e3, "step": torch_step * 1e3}}


def _make_batch(config, B, T, seed=0):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, config.vocab_size, (B, T), dtype=np.int64)
    targets = rng.integers(0, config.vocab_size, (B, T), dtype=np.int64)
    return idx, targets


def compare(preset: str, *, batch: int | None = None, seq_len: int | None = None, threads: int = 2,
            repeat: int = 5, warmup: int = 1, attention: str = "sdpa", overrides=(), check_only: bool = False,
            gap: float = 0.01, seed: int = 0, profile_repeats: int = 1) -> dict:
    """Runs the check and (unless check_only) the interleaved timing for one configuration."""
    import torch  # optional dependency

    config = GPTConfig.preset(preset, dtype="float32").with_overrides(overrides)
    dB, dT = DEFAULT_SHAPES.get(preset, (4, min(256, config.block_size)))
    B, T = batch or dB, min(seq_len or dT, config.block_size)
    set_blas_threads(threads)
    torch.set_num_threads(threads)
    # as `cutp train` runs (train/step.py): freed step memory stays in the heap for the next step
    # (process-wide, so torch's CPU allocator, which is malloc, gets the same)
    keep_freed_host_memory()
    ctx = cutp.init(tp=1, device="cpu", abort_on_error=False)
    try:
        model = GPT(ctx, config, seed=seed)
        state = model.gather_state_dict()
        idx, targets = _make_batch(config, B, T, seed)
        if is_llama(config):
            hf_state = hf_state_dict(config, state)
            tmodel = build_torch_llama(config, hf_state, attention)
            reference = None if transformers_missing_reason() else build_transformers_llama(config, hf_state)
            check = check_same_llama(model, tmodel, idx, targets, reference=reference)
            del reference
        else:
            tmodel = build_torch_gpt(config, state, attention)
            check = check_same_work(model, tmodel, idx, targets)
        res = {"preset": preset, "config": config.to_dict(), "batch": B, "seq_len": T, "threads": threads,
               "blas_threads": get_blas_threads(), "torch_threads": torch.get_num_threads(),
               "torch": torch.__version__, "attention": attention, "check": check}
        if check_only or not check["ok"]:
            return res
        tidx, ttgt = torch.from_numpy(idx), torch.from_numpy(targets)

        def step_cutp():
            model.forward(idx, targets)
            model.backward()

        def step_torch():
            tmodel(tidx, ttgt).backward()

        tc, tt = Timing(), Timing()
        for i in range(warmup + repeat):
            # interleaved, alternating which goes first; grads zeroed outside the timed region
            order = (("cutp", step_cutp, tc), ("torch", step_torch, tt))
            for name, fn, acc in (order if i % 2 == 0 else order[::-1]):
                model.zero_grad()
                tmodel.zero_grad(set_to_none=True)
                # lets the other library's spinning worker threads go idle; longer gaps leave both
                # libraries with cold caches and sleeping threads (measured: 0.2 s slowed cutp by 10%)
                time.sleep(gap)
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if i >= warmup:
                    acc.times.append(dt)
        splits = []
        for _ in range(profile_repeats):
            model.zero_grad()
            tmodel.zero_grad(set_to_none=True)
            splits.append(_profiled_split(step_cutp, step_torch, ops))
        if splits:
            res["profiled_ms"] = {side: {key: float(np.median([s[side].get(key, 0.0) for s in splits]))
                                         for key in splits[0][side]} for side in ("cutp", "torch")}
            res["gemm_floor"] = res["profiled_ms"]["cutp"].get("gemm", 0.0) / (tt.median * 1e3)
        tokens = B * T
        res.update({"cutp": tc.as_dict(), "torch_timing": tt.as_dict(),
                    "cutp_ms": tc.median * 1e3, "torch_ms": tt.median * 1e3, "ratio": tc.median / tt.median,
                    "cutp_tok_s": tokens / tc.median, "torch_tok_s": tokens / tt.median})
        return res
    finally:
        ctx.close()


def run(args) -> Report:
    check_presets(args.presets, getattr(args, "set", ()))  # (before torch is looked for: it needs none)
    report = Report("compare-torch", machine_info())
    why = torch_missing_reason()
    if why:
        report.notes.append(f"skipped: {why}")
        report.extra["skipped"] = why
        return report
    import torch  # optional dependency

    report.meta["torch"] = torch.__version__
    t = report.table("compare", [
        ("preset", "preset", "", "<"), ("shape", "B x T", "", "<"), ("threads", "threads", "d"),
        ("attention", "torch attn", "", "<"), ("loss", "loss (cutp)", ".5f"), ("dloss", "|dloss|/loss", ".1e"),
        ("dgrad", "max grad rel diff", ".1e"), ("cutp_ms", "cutp ms", ".1f"), ("torch_ms", "torch ms", ".1f"),
        ("ratio", "cutp/torch", ".3f"), ("cutp_tok_s", "cutp tok/s", ",.0f"), ("torch_tok_s", "torch tok/s", ",.0f"),
    ], title="forward+backward, float32, median of interleaved repeats")
    split = report.table("split", [
        ("preset", "preset", "", "<"), ("cutp_gemm", "cutp gemm ms", ".1f"), ("cutp_rest", "cutp rest ms", ".1f"),
        ("cutp_top", "cutp's largest rest", "", "<"), ("torch_gemm", "torch gemm ms", ".1f"),
        ("torch_rest", "torch rest ms", ".1f"), ("floor", "cutp gemm / torch step", ".3f"),
    ], title="where a step goes: profiled steps after the timed ones (medians)")
    results = []
    for preset in args.presets:
        r = compare(preset, batch=args.batch_size, seq_len=args.seq_len, threads=args.threads, repeat=args.repeat,
                    warmup=args.warmup, attention=args.torch_attention, overrides=args.set,
                    check_only=args.check_only, gap=args.gap, profile_repeats=args.profile_repeats)
        results.append(r)
        chk = r["check"]
        t.add(preset=preset, shape=f"{r['batch']} x {r['seq_len']}", threads=r["threads"], attention=r["attention"],
              loss=chk["loss_cutp"], dloss=chk["loss_rel_diff"], dgrad=max(chk["grads"].values(), default=None),
              cutp_ms=r.get("cutp_ms"), torch_ms=r.get("torch_ms"), ratio=r.get("ratio"),
              cutp_tok_s=r.get("cutp_tok_s"), torch_tok_s=r.get("torch_tok_s"))
        if "profiled_ms" in r:
            c, tp = r["profiled_ms"]["cutp"], r["profiled_ms"]["torch"]
            rest = {kind: c.get(kind, 0.0) for kind in OP_KINDS if kind != "gemm"}
            rest["outside the ops"] = max(0.0, c["step"] - sum(rest.values()) - c.get("gemm", 0.0))
            top = sorted(rest.items(), key=lambda kv: -kv[1])[:3]
            split.add(preset=preset, cutp_gemm=c.get("gemm", 0.0), cutp_rest=r["cutp_ms"] - c.get("gemm", 0.0),
                      cutp_top=", ".join(f"{kind} {ms:.0f}" for kind, ms in top), torch_gemm=tp.get("gemm"),
                      torch_rest=r["torch_ms"] - tp["gemm"] if "gemm" in tp else None, floor=r["gemm_floor"])
        if not chk["ok"]:
            report.notes.append(f"{preset}: cutp and torch DISAGREE ({chk}); not timed")
            # a failed check is the command's failure (python -m cutp bench exits 1: make compare-torch fails)
            report.extra.setdefault("disagree", []).append(preset)
        if "transformers" in chk:
            tr = chk["transformers"]
            report.notes.append(f"{preset}: the torch module against transformers' LlamaForCausalLM: |dloss|/loss "
                                f"{tr['loss_rel_diff']:.1e}, max grad rel diff {max(tr['grads'].values()):.1e}")
        elif is_llama(GPTConfig.preset(preset)):
            report.notes.append(f"{preset}: not checked against transformers ({transformers_missing_reason()})")
    t.notes.append("ratio < 1: cutp is faster. Same weights, batch and thread count (torch.set_num_threads and "
                   "cutp.runtime.threads.set_blas_threads); gradients zeroed outside the timed region.")
    split.notes.append("gemm: the linear layers' GEMMs (cutp: ops.profile's gemm kind; torch: aten.mm and "
                       "aten.addmm timed in a dispatch mode); rest: the timed median minus the profiled step's GEMMs "
                       "(cutp's largest rest: in its profiled step). cutp gemm / torch step: the ratio cutp would "
                       "reach with nothing but its GEMMs, against the timed torch median.")
    report.extra["results"] = results
    return report
