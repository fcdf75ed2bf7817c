"""Inference: the cached incremental forward (``cache``) and sampling (``generate``)."""
