"""The planner: memory and communication per GPU for a model and a layout, without hardware.

layout    one rank of a TP x DP mesh: state bytes, activations, communication (`plan`)
pipeline  each stage of a pipeline: its memory, the p2p bytes, the bubble (`plan_pipeline`)
search    the TP x PP x DP layouts that fit a GPU
moe       mixture-of-experts layers' parameters, activations and all-to-all traffic
cli       `python -m cutp plan` (and `python -m cutp bench plan`)
"""
