"""The exposed DP communication a layout should see on a given link (`python -m cutp plan
--link-bandwidth GB/s [--link-latency us] --device-tflops T [--bucket-size N]`).

The last micro-batch's backward runs the units of the model in reverse (the LM head with the
final norm, the layers last to first, the embeddings), each taking its FLOPs (a layer's
forward: 2 x its parameters per rank x tokens + the attention's 4 x s^2 x h / tp per sequence,
4 x s x min(s, window) x h / tp for a local layer;
backward twice the forward) divided by the device throughput. The gradient buckets
(cutp.optim.buckets) are cut in that order, `bucket_size` elements each, a unit's parameters
never split; a tied embedding's gradient is final only after the embeddings' backward. Each
bucket's reduction occupies the link for latency + wire bytes / bandwidth, one at a time, from
when its last unit's backward ends (with overlap), or all after the backward (without); the
exposed time is how far the last one ends after the backward does. Wire bytes per rank: an
all-reduce 2 (d-1)/d of the bucket, the distributed optimizer's reduce (d-1)/d (its
reduce-scatter); 4 bytes a gradient element (the float32 buffer), 2 with --grad-reduce-dtype
bfloat16. (cutp's flat buffer puts biases and norms after the matrices, so their bucket is
final only at the end; they are ~0.1% of a GPT's elements, left out here.)

The same link simulated under a real run: `cutp bench model --link-bandwidth --link-latency`
reports the link's exposed time measured (`link_exposed_ms`), for the comparison.
"""
from __future__ import annotations

from ..optim import default_bucket_size
from ..runtime.errors import ConfigError


def backward_units(a, tp: int, micro_batch: int, seq_len: int, param_count) -> list[tuple[str, int, float]]:
    """(name, gradient elements final after it, forward FLOPs) per unit, in backward order."""
    p = param_count(a, tp)
    tokens = micro_batch * seq_len
    head_params = p["head_per_rank"] or p["embedding_per_rank"]  # tied: the embedding's table
    units = [("head + final norm", p["final_norm"] + p["head_per_rank"], 2 * head_params * tokens)]
    for i in reversed(range(a.n_layer)):
        keys = seq_len if a.layer_window(i) is None else min(seq_len, a.layer_window(i))  # a local layer's
        attention = 4 * micro_batch * seq_len * keys * a.n_embd // tp  # scores and their product with V
        units.append((f"layer {i}", p["layer_per_rank"], 2 * p["layer_per_rank"] * tokens + attention))
    units.append(("embeddings", p["embedding_per_rank"] + p["position"], 0.0))
    return units


def expected_exposed(units, *, dp: int, bucket_size: int, bandwidth_gbs: float, latency_us: float,
                     device_tflops: float, distributed_optimizer: bool, grad_bytes: int = 4) -> dict:
    """The DP reduction's buckets, link time and exposed time with and without overlap."""
    factor = (dp - 1) / dp * (1 if distributed_optimizer else 2)
    buckets, elements, t, ready = [], 0, 0.0, []
    for name, n, flops in units:
        t += 2 * flops / (device_tflops * 1e12)  # backward: twice the forward
        elements += n
        if elements >= bucket_size or name == "embeddings":
            buckets.append(elements)
            ready.append(t)
            elements = 0
    backward_s = t
    link = [latency_us * 1e-6 + b * grad_bytes * factor / (bandwidth_gbs * 1e9) for b in buckets]
    free = 0.0
    for r, took in zip(ready, link):
        free = max(free, r) + took
    exposed_on = max(0.0, free - backward_s)
    total = sum(link)
    return {"buckets": len(buckets), "bucket_bytes": [b * grad_bytes for b in buckets], "link_ms": total * 1e3,
            "backward_ms": backward_s * 1e3, "exposed_ms_without_overlap": total * 1e3,
            "exposed_ms_with_overlap": exposed_on * 1e3,
            "overlap_fraction": None if total <= 0 else 1 - exposed_on / total}


def check_args(args) -> None:
    """Before any planning: ConfigError for a link without a device throughput, a throughput
    without a link, or a bandwidth, latency or throughput that no link has (0 GB/s divided by
    zero, a negative one printed negative times)."""
    bandwidth, tflops = getattr(args, "link_bandwidth", None), getattr(args, "device_tflops", None)
    if bandwidth is not None and not bandwidth > 0:
        raise ConfigError(f"--link-bandwidth {bandwidth:g}: a link moves more than 0 GB/s; give e.g. "
                          "--link-bandwidth 50 (InfiniBand NDR per GPU), or omit it")
    if bandwidth is not None and getattr(args, "link_latency", 0) < 0:
        raise ConfigError(f"--link-latency {args.link_latency:g}: a latency is >= 0 us; give e.g. --link-latency 5")
    if tflops is not None and not tflops > 0:
        raise ConfigError(f"--device-tflops {tflops:g}: give the throughput a layer's FLOPs run at, > 0, e.g. "
                          "--device-tflops 400")
    if bandwidth is not None and not tflops:
        raise ConfigError("--link-bandwidth needs --device-tflops (the throughput each layer's FLOPs run at): give "
                          "it, e.g. --device-tflops 400 for a bf16 H100 at about half its peak")
    if tflops is not None and bandwidth is None:
        raise ConfigError("--device-tflops times the backward against a simulated link, and no --link-bandwidth "
                          "is given; give --link-bandwidth GB/s too, or omit --device-tflops")


def add_table(report, a, args, param_count) -> dict | None:
    """The plan's table of expected exposed DP communication (when --link-bandwidth is given)."""
    if getattr(args, "link_bandwidth", None) is None or args.dp <= 1:
        return None
    seq = args.seq_len or a.block_size
    units = backward_units(a, args.tp, args.micro_batch, seq, param_count)
    size = args.bucket_size or default_bucket_size(args.dp, sum(n for _, n, _ in units))
    r = expected_exposed(units, dp=args.dp,
                         bucket_size=size, bandwidth_gbs=args.link_bandwidth, latency_us=args.link_latency,
                         device_tflops=args.device_tflops, distributed_optimizer=args.distributed_optimizer)
    t = report.table("overlap", [("what", "DP gradient reduction", "", "<"), ("v", "", "", "<")],
                     title=f"expected exposed communication ({args.link_bandwidth:g} GB/s, {args.link_latency:g} us, "
                           f"{args.device_tflops:g} TFLOP/s)")
    sizes = r["bucket_bytes"]
    for k, v in (("buckets", f"{r['buckets']} of {size:,} elements (MB: first {sizes[0] / 1e6:,.1f}, last "
                              f"{sizes[-1] / 1e6:,.1f})"),
                 ("link time", f"{r['link_ms']:,.2f} ms per step"),
                 ("last backward", f"{r['backward_ms']:,.2f} ms"),
                 ("exposed, no overlap", f"{r['exposed_ms_without_overlap']:,.2f} ms"),
                 ("exposed, --overlap-grad-reduce", f"{r['exposed_ms_with_overlap']:,.2f} ms"),
                 ("hidden", "-" if r["overlap_fraction"] is None else f"{100 * r['overlap_fraction']:.1f}%")):
        t.add(what=k, v=v)
    report.extra["overlap"] = r
    return r
