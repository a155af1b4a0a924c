"""The validation loss of a training run (cutp.train.step's `TrainingRun`): the masked targets of
its validation batches, each counted once whatever the layout."""
from __future__ import annotations

from ..data import model_kwargs
from .pipeline import eval_losses
from .reductions import dp_sums, from_last_stage


def evaluate(run) -> float:
    """The loss over the targets of `eval_batches` validation batches (the same ones at every
    evaluation; chat data: its masked targets, each counted once, whatever the layout), in eval
    mode (no dropout). Collective."""
    cfg, ctx, model = run.config, run.ctx, run.model
    run.settle_params()  # (zero 3: each unit gathered for its forward, as in training)
    with ctx.watchdog.watch_progress(f"the evaluation after step {run.step}"):
        model.eval()
        total, count = 0.0, 0
        for i in range(cfg.eval_batches):
            batches = list(run.sampler.micro_batches(i, "val"))
            counts = [int((y != model.ignore_index).sum()) for _, y in batches]
            if ctx.pp_size > 1:
                losses = eval_losses(run, batches)  # (none off the last stage)
            else:
                losses = []
                for batch in batches:
                    x, y = batch
                    model.check_inputs(x, y)
                    losses.append(model.forward(ctx.asarray(x), ctx.asarray(y), check=False,
                                                **model_kwargs(batch, ctx.asarray)))
                    ctx.watchdog.progress()
            total += sum(float(loss) * c for loss, c in zip(losses, counts) if c)
            count += sum(counts)
        model.train()
        total, count = dp_sums(ctx, [total, count], "the validation-loss sum")
        loss = total / count if count else 0.0
        return from_last_stage(ctx, loss) if ctx.pp_size > 1 else loss

