"""Which layers each pipeline stage (and each interleaved model chunk) holds. Pure."""
from __future__ import annotations

from ..runtime.errors import ConfigError


def virtual_stage_layers(n_layer: int, pp: int, pp_layers=None, virtual: int = 1) -> list[range]:
    """The global layer indices of each of the pp * virtual model chunks, in the model's order:
    n_layer / (pp * virtual) each, or the counts `pp_layers` (e.g. (5, 6, 6, 5)). Chunk k runs
    on pipeline stage k % pp (Megatron's interleaved layout: stage s holds chunks s, s + pp, ...).
    Raises ConfigError naming the numbers."""
    n = pp * virtual
    chunks = f"pp={pp} stages" if virtual == 1 else f"pp={pp} x `pp_virtual` {virtual} = {n} model chunks"
    if n_layer < n:
        raise ConfigError(f"n_layer={n_layer} cannot fill {chunks}: each needs at least one layer, so n_layer must "
                          f"be at least pp x V = {pp} x {virtual} = {n}; {_fewer_chunks(n_layer, pp, virtual)}")
    if pp_layers is None:
        if n_layer % n:
            raise ConfigError(f"n_layer={n_layer} does not split evenly over {chunks}; give the layers of "
                              f"each {'stage' if virtual == 1 else 'chunk, in the model order,'} with `pp_layers` "
                              f"(e.g. {','.join(map(str, near_even(n_layer, n)))})")
        counts = [n_layer // n] * n
    else:
        counts = [int(k) for k in pp_layers]
        if len(counts) != n or min(counts) < 1 or sum(counts) != n_layer:
            what = f"pp={pp}" if virtual == 1 else f"{chunks} (one per chunk, in the model's order):"
            raise ConfigError(f"`pp_layers` {','.join(map(str, counts))}: needs {what} counts >= 1 that add up to "
                              f"n_layer={n_layer} (e.g. {','.join(map(str, near_even(n_layer, n)))})")
    starts = [sum(counts[:i]) for i in range(n)]
    return [range(a, a + k) for a, k in zip(starts, counts)]


def stage_layers(n_layer: int, pp: int, pp_layers=None, virtual: int = 1) -> list:
    """The global layer indices of each of the pp pipeline stages: a range per stage, or with
    virtual > 1 model chunks per stage, the list of its chunks' layers (`virtual_stage_layers`)."""
    chunks = virtual_stage_layers(n_layer, pp, pp_layers, virtual)
    if virtual == 1:
        return chunks
    return [[i for c in range(virtual) for i in chunks[c * pp + s]] for s in range(pp)]


def _fewer_chunks(n_layer: int, pp: int, virtual: int) -> str:
    """The fixes for a model of fewer layers than model chunks: more layers, or fewer chunks per
    stage (not fewer stages: whether those divide the ranks is the caller's to say)."""
    fixes = [f"a model of at least {pp * virtual} layers (n_layer={pp * virtual})"]
    if virtual > 1 and n_layer >= pp:
        v = n_layer // pp
        fixes.append((f"`pp_virtual` {v}" if v > 1 else "no `pp_virtual`")
                     + (f" (and `pp_layers` {','.join(map(str, near_even(n_layer, pp * v)))})" if n_layer % (pp * v)
                        else ""))
    return "use " + (" or ".join(fixes) if len(fixes) <= 2 else ", ".join(fixes[:-1]) + " or " + fixes[-1])


def near_even(n, k):
    return [n // k + (1 if i >= k - n % k else 0) for i in range(k)]
