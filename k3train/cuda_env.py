"""Process-wide CUDA settings that must be made before CUDA initialises."""
from __future__ import annotations

import os

from k3train.config import RunConfig


def prepare_cuda_env(cfg: RunConfig) -> None:
    """Call before anything touches CUDA (the CLI does, right after loading the config).

    Pipeline parallelism on GPUs: load every CUDA kernel when the context is created
    (``CUDA_MODULE_LOADING=EAGER``) instead of at its first launch. The pipeline posts NCCL
    receives ahead and its sends wait for the peer, so p2p kernels are spinning on the GPU
    whenever step 1 launches a kernel for the first time, and CUDA's lazy loading can stall a
    device with kernels in flight (the CUDA programming guide's lazy-loading caveat about
    kernels that wait on each other). A PP=2 run on 2x H200 hung in its first backward with
    lazy loading: both ranks inside autograd, each GPU waiting on the other.

    For the same reason ``torch.compile`` is off by default in those runs
    (``K3TRAIN_COMPILE=0``): Inductor loads the kernels it generates at their first call, inside
    the step. Triton kernels of fla are loaded before step 1 by ``compile_ahead``. Values the
    user set are kept.
    """
    if cfg.parallel.pp > 1 and cfg.train.device != "cpu":
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
        os.environ.setdefault("K3TRAIN_COMPILE", "0")
