"""Process-wide CUDA settings that must be made before CUDA initialises."""
from __future__ import annotations

import os
import warnings

from k3train.config import RunConfig


def prepare_cuda_env(cfg: RunConfig) -> None:
    """Call before anything touches CUDA (the CLI does, right after loading the config, and
    ``train()`` does again first thing, for callers that skip the CLI).

    Pipeline parallelism on GPUs: load every CUDA kernel when the context is created
    (``CUDA_MODULE_LOADING=EAGER``) instead of at its first launch. The pipeline posts NCCL
    receives ahead and its sends wait for the peer, so p2p kernels are spinning on the GPU
    whenever step 1 launches a kernel for the first time, and CUDA's lazy loading can stall a
    device with kernels in flight (the CUDA programming guide's lazy-loading caveat about
    kernels that wait on each other). A PP=2 run on 2x H200 hung in its first backward with
    lazy loading: both ranks inside autograd, each GPU waiting on the other. Inductor loads the
    kernels it generates at their first call too; compile-ahead (``TrainState.compile_kernels``)
    makes that call on every rank before step 1 (``k3train/ops/kernels.py``). A value the user
    set is kept.
    """
    if cfg.parallel.pp > 1 and cfg.train.device != "cpu" and "CUDA_MODULE_LOADING" not in os.environ:
        import torch

        if torch.cuda.is_initialized():
            warnings.warn("CUDA was initialised before the pipeline run set CUDA_MODULE_LOADING=EAGER; "
                          "set it in the environment to avoid first-step stalls", stacklevel=2)
        os.environ["CUDA_MODULE_LOADING"] = "EAGER"
