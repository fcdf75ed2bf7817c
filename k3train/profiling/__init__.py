"""Measurement of a model on the hardware: the pipeline profiler and the pipeline timing model's per-layer costs."""
