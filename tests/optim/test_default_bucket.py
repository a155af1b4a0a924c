"""The default gradient bucket (issue 43): a model smaller than Megatron's 40M-element bucket was
one bucket, reduced after the whole backward (0% hidden); the default now cuts at least a few
buckets of any buffer, and the run says how many."""
from types import SimpleNamespace

from cutp.models import GPT, GPTConfig
from cutp.optim import FlatParameters
from cutp.optim.buckets import MIN_BUCKETS, cut_buckets, default_bucket_size
from cutp.train.reporting import bucket_line
from tests.tp_utils import self_ctx


def test_megatrons_size_for_large_buffers_an_eighth_of_small_ones():
    assert default_bucket_size(2) == default_bucket_size(2, 10 ** 10) == 40_000_000
    assert default_bucket_size(64, 10 ** 10) == 64_000_000
    assert default_bucket_size(2, 1_000_000) == 1_000_000 // MIN_BUCKETS
    assert default_bucket_size(2, 3) == 1


def test_a_small_model_is_cut_into_several_buckets_and_the_run_says_how_many():
    ctx = self_ctx()
    model = GPT(ctx, GPTConfig.preset("tiny"), seed=0)
    flat = FlatParameters(model.parameters())
    buckets = cut_buckets(flat, default_bucket_size(2, sum(p.data.size for p in model.parameters())))
    sizes = [b.size for b in buckets]
    assert len(sizes) >= MIN_BUCKETS // 2 and max(sizes) < flat.padded_size / 2, sizes
    line = bucket_line(SimpleNamespace(grad_buckets=SimpleNamespace(buckets=buckets)))
    assert line.startswith(f"overlap: the DP gradient reduction in {len(sizes)} buckets of {min(sizes):,} to ")
    one = bucket_line(SimpleNamespace(grad_buckets=SimpleNamespace(buckets=cut_buckets(flat, 10 ** 9))))
    assert "in 1 bucket of" in one and "nothing hidden" in one
    assert bucket_line(SimpleNamespace(grad_buckets=None)) is None
    ctx.close()
