"""Training as a library: the pieces every caller composes (examples/train_gpt.py, `cutp bench
model`, a host code that trains on a sub-communicator of its own).

config     RunConfig (every setting of a run, frozen) and resolve_run_config, the one place its
           defaults are derived, validated and compared across ranks; command_line_parser
settings   a setting declared once (type, default, allowed values, help, check): RunConfig's
           fields, the parser and the flag names of error messages come from it
step       build_run (context, model, optimizer, data; resumed), train_step -> StepStats,
           evaluate, save, resume, StepHooks
signals    StopOnSignal: SIGTERM/SIGINT end the run after the current step, on every rank
reporting  MetricsLog (the JSONL metrics file) and progress_line
sampling   PromptSampler: --sample-every's generations (chat data: the prompt templated)
memory     memory per rank, measured: state_bytes (params, grads, optimizer), ActivationPeak
           (the peak of a step), stash_per_layer (what each layer keeps for backward), measured_step,
           memory_record, max_over_ranks
finetune   what trains: --freeze's groups and LoRA adapters (cutp.tensor_parallel.lora) on a run's model

    from cutp import train
    cfg = train.resolve_run_config(preset="tiny", steps=100, tp=2)
    run = train.build_run(cfg)
    while run.step < run.end_step:
        stats = train.train_step(run)
    train.save(run)
    run.close()
"""
from .config import (CHOICES, RUN_SETTINGS, SETTINGS, RunConfig, command_line_parser, flag_name, resolve_run_config,
                     resume_note, resume_out)
from . import finetune
from .defaults import choose_tp, default_preset
from .memory import ActivationPeak, max_over_ranks, measured_step, memory_record, stash_per_layer, state_bytes
from .reporting import MetricsLog, Progress, TensorBoardLog, bucket_line, gpu_name, known_peak_tflops, model_summary, \
    parameter_counts, progress_line
from .sampling import PromptSampler
from .signals import StopOnSignal
from .evaluation import evaluate
from .step import StepHooks, StepStats, TrainingRun, build_run, resume, save, train_step

__all__ = [
    "CHOICES", "RUN_SETTINGS", "SETTINGS", "RunConfig", "choose_tp", "command_line_parser", "default_preset",
    "flag_name", "resolve_run_config", "resume_note", "resume_out",
    "MetricsLog", "Progress", "TensorBoardLog", "bucket_line", "gpu_name", "known_peak_tflops", "model_summary", "parameter_counts", "progress_line",
    "StopOnSignal",
    "PromptSampler",
    "ActivationPeak", "max_over_ranks", "measured_step", "memory_record", "stash_per_layer", "state_bytes",
    "StepHooks", "StepStats", "TrainingRun", "build_run", "evaluate", "resume", "save", "train_step",
]
