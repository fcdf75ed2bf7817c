"""Muon: momentum orthogonalised by a Newton-Schulz iteration, with optional per-head blocks.

The update for a 2-D weight ``W: [A, B]`` (A = output rows, B = input columns) is

    buf = mu * buf + g                      # heavy-ball momentum
    u   = g + mu * buf  (nesterov)  or  buf
    O   = newton_schulz(u)                  # ~ U V^T of u's SVD, singular values near 1
    W  *= 1 - lr * wd                       # decoupled weight decay
    W  -= lr * 0.2 * sqrt(max(A, B)) * O

The ``0.2 * sqrt(max(A, B))`` factor is the Moonlight scaling: an orthogonal-like ``[A, B]``
matrix has RMS ``~1 / sqrt(max(A, B))``, so the scaled update has RMS ``~0.2``, about what AdamW
gives. That lets Muon reuse AdamW's learning rate and weight decay.

A 3-D parameter ``[S, A, B]`` (the routed experts' stacked weights) is a stack of ``S``
matrices, each orthogonalised and scaled on its own, exactly as ``S`` separate 2-D parameters.

Per-head Muon (``heads=H``) splits the momentum's rows into ``H`` blocks ``[H, A/H, B]`` (one
block per attention head of a q/k/v projection) and orthogonalises each block on its own. The
scale then uses the block's shape, ``0.2 * sqrt(max(A/H, B))``, so that each block's update, and
hence the whole matrix's, still has RMS ~0.2.

Tensor parallelism (``tp_group``): a weight sharded over TP ranks (megatron-core's
``tensor_model_parallel`` / ``partition_dim`` attributes) is orthogonalised as the whole matrix
it is a slice of, because Newton-Schulz of a slice is not the slice of Newton-Schulz of the
matrix. Where a block straddles the shards (``TPShard``: a column-parallel weight's rows, a
row-parallel weight's columns), every TP rank all-gathers the momentum-applied inputs of its
shard, runs the iteration on the whole blocks (and the scale on their whole shape) and keeps
its own slice. Where the blocks lie inside one shard (per-head blocks of a row-sharded q/k/v
projection, whose ``heads`` counts this rank's heads; the experts of a stack sharded along
the stack) the local step is already exact and nothing is gathered
(docs/optim_sharding.md#muon-under-tensor-parallelism).
"""
from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass, replace
from typing import Any, Iterable

import torch
import torch.distributed as dist

from .backends import current as current_backends
from .ns_gram import NS_MODES, NSMode, gram_iterate, use_gram

__all__ = ["NS_COEFFICIENTS", "TPShard", "apply_muon_updates", "largest_first", "momentum_input",
           "newton_schulz", "muon_scale", "ns_flops", "ns_update", "scratch_muon_updates", "tp_shard",
           "gather_tp_blocks", "tp_gather_bytes", "tp_slice", "tp_split_dim",
           "muon_update", "muon_updates", "Muon"]

# Quintic p(x) = a x + b x^3 + c x^5 applied to the singular values. The large slope a at 0
# pulls small singular values up fast; the price is that 1 is not a fixed point (p(1) ~ 0.70),
# so after a few steps singular values sit in a band around 1 rather than at 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def _ns_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the Newton-Schulz iteration runs in for a tensor like ``t``: bf16 on CUDA,
    fp32 elsewhere; fp64 stays fp64 (reference runs: an fp64 test then compares at fp64
    rounding, not fp32's)."""
    if t.dtype == torch.float64:
        return torch.float64
    return torch.bfloat16 if t.is_cuda else torch.float32




@functools.cache
def _triton_kernel(module: str, name: str):
    """``name`` from ``optim.<module>``, or None where Triton is not importable (it ships
    with CUDA builds of torch; CPU-only installs may lack it)."""
    try:
        return getattr(importlib.import_module(f".{module}", __package__), name)
    except ImportError:
        return None


def _cuda_kernel(t: torch.Tensor, family: str, module: str, name: str):
    """Our Triton kernel ``module.name`` for tensors like ``t``: None off CUDA, where ``family``'s
    backend is torch (``optim.backends``, set by the run's kernel registry), or without Triton."""
    if not t.is_cuda or getattr(current_backends(), family) != "k3train":
        return None
    return _triton_kernel(module, name)


def _baddbmm(X: torch.Tensor):
    """The ``baddbmm(C, A, B, beta=, alpha=)`` to use for tensors like ``X``."""
    # The Triton grid puts the stack on its second axis, which CUDA caps at 65535. The kernel
    # accumulates in fp32, so fp64 (a reference run) takes torch's: Triton refused to compile it
    # for fp64 operands on an H200 (2026-12-04, benchmarks/bench_gram_ns.py's fp64 map).
    if X.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return torch.baddbmm
    ours = _cuda_kernel(X, "ns_gemm", "ns_gemm_triton", "baddbmm_triton")
    return ours if ours is not None and X.shape[0] <= 65535 else torch.baddbmm


def newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7, *,
                  out_scale: float = 1.0, mode: NSMode = "standard") -> torch.Tensor:
    """Approximately orthogonalise ``G: [..., A, B]`` (each trailing matrix on its own).

    Returns ``out_scale`` times a tensor of ``G``'s shape and dtype whose trailing matrices
    have singular values near 1 and the same singular vectors as ``G``'s. Works in bf16 on
    CUDA (the iteration is robust to it and tensor cores make it cheap) and in fp32 on CPU
    (bf16 matmuls are slow there). Leading dims are a batch, so per-head blocks
    ``[H, A/H, B]`` run in one call. ``out_scale`` rides on the last GEMM (no extra pass).

    ``mode``: "standard" (below), "gram" (the same polynomial map iterated on the ``[a, a]``
    Gram matrix, ``optim.ns_gram``), or "auto" (gram where its FLOPs are lower by
    ``ns_gram.GRAM_AUTO_FACTOR``: blocks far from square).
    """
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a [..., A, B] tensor, got shape {tuple(G.shape)}")
    a, b, c = NS_COEFFICIENTS
    X = G.to(_ns_dtype(G))
    # Iterate on the wide orientation so the Gram matrix X X^T is the smaller min(A, B)^2 one.
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    # Frobenius norm >= spectral norm, so every singular value starts in [0, 1].
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    # Batched GEMMs with the polynomial's scalars fused in (beta * C + alpha * A @ B): each step
    # is three GEMM launches and no separate elementwise passes over the stack. torch.baddbmm
    # copies C into its output first; ours (the ns_gemm kernel) reads C in the GEMM's epilogue instead.
    # (Folding a X into the GEMM as B + a I would also avoid that copy, but rounding a + B_ii to
    # bf16 doubled the update's error against fp32: 2.1% instead of 1.0%.)
    X = X.reshape(-1, *X.shape[-2:])
    baddbmm = _baddbmm(X)
    if use_gram(mode, X.size(-2), X.size(-1), steps):
        X = gram_iterate(X, steps, coefficients=NS_COEFFICIENTS, baddbmm=baddbmm, out_scale=out_scale)
        return (X.mT if tall else X).reshape(G.shape).to(G.dtype)
    for i in range(steps):
        s = out_scale if i == steps - 1 else 1.0  # the last step writes out_scale * X
        A = X @ X.mT
        B = baddbmm(A, A, A, beta=b, alpha=c)
        X = baddbmm(X, B, X, beta=a * s, alpha=s)
    if tall:
        X = X.mT
    return X.reshape(G.shape).to(G.dtype)


def muon_scale(rows: int, cols: int) -> float:
    """Moonlight update scale for an orthogonalised ``[rows, cols]`` block: RMS ~0.2 after it."""
    return 0.2 * math.sqrt(max(rows, cols))


def ns_flops(rows: int, cols: int, steps: int = 5) -> int:
    """FLOPs of ``steps`` quintic Newton-Schulz steps on one ``[rows, cols]`` matrix (block).

    On the wide orientation ``[a, b]`` (``a = min``, ``b = max``) each step is the Gram product
    ``X X^T`` (2a^2b), ``b A + c A A`` (2a^3) and ``B X`` (2a^2b); elementwise work is ignored.
    """
    a, b = sorted((rows, cols))
    return steps * (4 * a * a * b + 2 * a ** 3)


# torch 2.13 renamed the flat all-gather; keep the old name for torch 2.8 .. 2.12.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class TPShard:
    """How a Muon parameter's Newton-Schulz blocks are split over tensor parallelism: rank
    ``rank`` of the ``world`` ranks of ``group`` holds the ``rank``-th contiguous slice of every
    block ``[rows, cols]`` along ``dim`` (-2: rows, -1: columns), megatron-core's layout.

    ``group=None`` is a shape-only stand-in (``scratch``): the "gather" then tiles this rank's
    slice ``world`` times, with no communication, so compile-ahead sees the whole shapes."""

    group: Any
    world: int
    rank: int
    dim: int

    def scratch(self) -> "TPShard":
        return replace(self, group=None)


def tp_shard(p: torch.Tensor, heads: int | None, group) -> TPShard | None:
    """``p``'s ``TPShard`` over the tensor-parallel ``group``, or None where Muon's local step on
    ``p`` is already exact: ``p`` is not TP-sharded (no ``tensor_model_parallel``), ``group``
    has one rank (None: no TP), ``p`` is a stack ``[S, A, B]`` sharded along ``S``, or its
    per-head row blocks lie inside its row shard (``heads`` then counts this rank's heads).

    ``p``: ``[A, B]`` or ``[S, A, B]``, this rank's shard; ``partition_dim`` indexes its dims."""
    if group is None or not dist.is_initialized():
        return None
    dim = tp_split_dim(p, heads)
    world = dist.get_world_size(group)
    if dim is None or world == 1:
        return None
    return TPShard(group, world, dist.get_rank(group), dim)


def tp_split_dim(p: torch.Tensor, heads: int | None) -> int | None:
    """The dim of ``p``'s Newton-Schulz blocks ``[rows, cols]`` that tensor parallelism splits
    (-2 or -1), or None where no block straddles TP shards (``tp_shard``'s cases). Needs no
    process group: ``p``'s megatron-core attributes decide."""
    if not getattr(p, "tensor_model_parallel", False):
        return None
    if getattr(p, "partition_stride", 1) != 1:
        raise ValueError(f"Muon under tensor parallelism needs contiguous shards (partition_stride 1); "
                         f"a parameter of shape {tuple(p.shape)} has partition_stride {p.partition_stride}")
    dim = p.partition_dim - p.ndim  # -3 (stack), -2 (rows), -1 (columns)
    if dim == -3 or (dim == -2 and heads is not None):
        return None
    return dim


def tp_gather_bytes(params: Iterable[tuple[torch.Tensor, int | None]], tp: int, *,
                    element_size: int) -> int:
    """Bytes one rank receives per step in Muon's TP all-gathers when it orthogonalises every
    Muon parameter of ``params`` (``(this rank's shard, heads)``) itself, as the replicated Muon
    does: ``(tp - 1) * numel`` elements of ``element_size`` (the Newton-Schulz dtype: 2 for bf16
    on CUDA) per gathered shard. Under distributed Muon or ZeRO-1 a rank gathers only the blocks
    it owns, about ``1 / dp`` of this."""
    if tp == 1:
        return 0
    return sum((tp - 1) * p.numel() * element_size for p, heads in params
               if tp_split_dim(p, heads) is not None)


def gather_tp_blocks(x: torch.Tensor, tp: TPShard) -> torch.Tensor:
    """``x: [m, r, c]`` (this rank's slice of ``m`` blocks) -> the whole blocks ``[m, W r, c]``
    (``tp.dim`` -2) or ``[m, r, W c]`` (-1), ``W = tp.world``: one all-gather over ``tp.group``."""
    x = x.contiguous()
    if tp.group is None:
        parts = [x] * tp.world
    else:
        flat = torch.empty(tp.world * x.numel(), dtype=x.dtype, device=x.device)
        _all_gather(flat, x.view(-1), group=tp.group)
        parts = list(flat.view(tp.world, *x.shape).unbind(0))
    return torch.cat(parts, dim=tp.dim)


def tp_slice(whole: torch.Tensor, tp: TPShard) -> torch.Tensor:
    """This rank's slice ``[m, r, c]`` of whole blocks ``[m, W r, c]`` / ``[m, r, W c]`` (a view)."""
    size = whole.shape[tp.dim] // tp.world
    return whole.narrow(tp.dim, tp.rank * size, size)


def ns_update(blocks: torch.Tensor, steps: int, alpha: float, tp: TPShard | None = None, *,
              mode: NSMode = "standard") -> torch.Tensor:
    """``alpha * muon_scale(rows, cols) * newton_schulz(blocks)`` for Newton-Schulz inputs
    ``blocks: [m, r, c]``; ``[rows, cols]`` is the shape of a whole block.

    ``tp`` None: the blocks are whole (``rows, cols = r, c``). Otherwise they are this rank's
    slices of blocks split over TP: all-gathered to the whole blocks (every rank of ``tp.group``
    calls this with the same shapes, in the same order), orthogonalised and scaled whole, and
    this rank's slice returned, ``[m, r, c]`` (a view; not contiguous). Every TP rank runs the
    same iteration on the same input, rather than one owner scattering the result: one
    collective instead of two, no owner plan to keep in step, and each rank's Newton-Schulz
    FLOPs for these blocks are the TP=1 run's. ``mode``: the Newton-Schulz form (``optim.ns_gram``)."""
    if tp is None:
        rows, cols = blocks.shape[-2:]
        return newton_schulz(blocks, steps, out_scale=alpha * muon_scale(rows, cols), mode=mode)
    whole = gather_tp_blocks(blocks, tp)
    rows, cols = whole.shape[-2:]
    return tp_slice(newton_schulz(whole, steps, out_scale=alpha * muon_scale(rows, cols), mode=mode), tp)


def _check_matrix(shape: tuple[int, ...], heads: int | None, name: str | None) -> None:
    """A Muon parameter is a matrix ``[A, B]`` or a stack ``[S, A, B]``; heads split 2-D rows."""
    what = f"parameter {name!r}" if name else "parameter"
    if len(shape) not in (2, 3):
        raise ValueError(f"Muon handles 2-D matrices and 3-D stacks of matrices; {what} has shape "
                         f"{shape} (route it to AdamW)")
    if heads is None:
        return
    if len(shape) != 2:
        raise ValueError(f"per-head Muon splits the rows of a 2-D matrix; {what} has shape {shape}")
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads must be a positive int or None for {what}, got {heads!r}")
    if shape[0] % heads != 0:
        raise ValueError(
            f"per-head Muon: {what} has {shape[0]} rows (shape {tuple(shape)}), "
            f"not divisible by heads={heads}"
        )


def muon_update(
    grad: torch.Tensor,
    buf: torch.Tensor,
    *,
    momentum: float,
    nesterov: bool,
    heads: int | None,
    ns_steps: int,
    ns_mode: NSMode = "standard",
) -> torch.Tensor:
    """Advance the momentum ``buf`` in place and return the scaled Muon update for one matrix
    (or one stack of matrices).

    ``grad, buf: [A, B]`` or ``[S, A, B]``. Returns ``update`` of that shape, in the
    Newton-Schulz dtype (bf16 on CUDA, fp32 elsewhere), such that the caller applies
    ``p = (1 - lr * wd) * p - lr * update``. With ``heads=H`` (2-D only) the rows are split
    into ``H`` blocks ``[H, A/H, B]`` orthogonalised separately. Standalone so that a sharded
    optimizer step can call it on whole matrices owned by one rank.
    """
    _check_matrix(tuple(grad.shape), heads, None)
    return muon_updates([grad], [buf], momentum=momentum, nesterov=nesterov, heads=heads,
                        ns_steps=ns_steps, ns_mode=ns_mode)[0]


def momentum_input(g: torch.Tensor, buf: torch.Tensor, out: torch.Tensor, *, momentum: float,
                   nesterov: bool) -> None:
    """Advance the momentum ``buf = mu * buf + g`` in place and write Newton-Schulz's input
    (``g + mu * buf`` with Nesterov, else ``buf``) into ``out``, cast on the store.

    ``g, buf, out``: one shape (``out`` in the Newton-Schulz dtype). On CUDA one Triton pass
    does both (torch needs two). The one place this arithmetic lives, so that the replicated
    and the distributed Muon (``optim.muon_distributed``) advance the momentum bit for bit alike.
    """
    fused = _cuda_kernel(g, "momentum", "momentum_triton", "momentum_nesterov_triton")
    if fused is not None and g.is_contiguous() and buf.is_contiguous():
        fused(g, buf, out, momentum, nesterov)
        return
    torch.add(g, buf, alpha=momentum, out=buf)          # buf = mu * buf + g
    if nesterov:
        torch.add(g, buf, alpha=momentum, out=out)      # u = g + mu * buf
    else:
        out.copy_(buf)


def muon_updates(
    grads: list[torch.Tensor],
    bufs: list[torch.Tensor],
    *,
    momentum: float,
    nesterov: bool,
    heads: int | None,
    ns_steps: int,
    alpha: float = 1.0,
    ns_mode: NSMode = "standard",
    tp: TPShard | None = None,
) -> list[torch.Tensor]:
    """``alpha`` times ``muon_update`` for several matrices (or stacks) of one shape
    ``[A, B]`` / ``[S, A, B]``.

    ``tp``: None, or how these matrices (this rank's shards, all split alike) are split over
    tensor parallelism; the blocks are then gathered, orthogonalised and scaled whole
    (``ns_update``), and this rank's slices returned. Collective over ``tp.group``.

    All matrices (all their head blocks) go through one batched Newton-Schulz
    ``[n * H, A/H, B]``: a handful of kernel launches instead of ~25 per matrix, which is what
    a step of many small matrices is bound by on a GPU. Each trailing matrix is orthogonalised
    on its own, so the result equals the one-by-one form. ``alpha`` (e.g. ``-lr``) rides on
    the last Newton-Schulz GEMM, so ``apply_muon_updates`` needs one pass per parameter.
    ``ns_mode``: ``newton_schulz``'s ``mode`` (standard, gram or auto; ``optim.ns_gram``).
    """
    ns_dtype = _ns_dtype(grads[0])
    u = torch.empty((len(grads), *grads[0].shape), dtype=ns_dtype, device=grads[0].device)
    # The Nesterov input is written straight into its slot of the Newton-Schulz stack.
    for i, (g, buf) in enumerate(zip(grads, bufs)):
        momentum_input(g, buf, u[i], momentum=momentum, nesterov=nesterov)
    rows, cols = u.shape[-2:]
    h = heads or 1
    ortho = ns_update(u.view(-1, rows // h, cols), ns_steps, alpha, tp, mode=ns_mode)
    # reshape, not view: tall blocks come back transposed (non-contiguous) from newton_schulz
    return list(ortho.reshape(u.shape).unbind(0))


def scratch_muon_updates(grads: list[torch.Tensor], bufs: list[torch.Tensor], **kwargs) -> None:
    """``muon_updates(grads, bufs, **kwargs)`` on zero tensors shaped like these (same shapes,
    dtypes, devices and layouts), its result dropped: the arguments are only templates.

    Why: compile-ahead (``k3train/ops/triton_compile.py``) runs this inside its compile-only
    pass, so the optimizer's Triton kernels compile in parallel with the model's before step 1.
    Otherwise they compile in step 1, one at a time: every distinct ``(M, N, K)`` of the
    Newton-Schulz GEMM is its own autotune key and ``K`` a compile-time constant, so each new
    matrix shape compiles and times every candidate again."""
    muon_updates([torch.zeros_like(g) for g in grads],
                 [torch.zeros_like(b, memory_format=torch.preserve_format) for b in bufs], **kwargs)


def apply_muon_updates(params: list[torch.Tensor], updates: list[torch.Tensor],
                       decay: float) -> None:
    """``p = decay * p + u`` for each parameter and its update, in one pass each.

    ``updates`` come from ``muon_updates(..., alpha=-lr)`` (the learning rate is already in
    them) and may be in a narrower dtype (bf16), promoted on the fly; ``decay`` is
    ``1 - lr * weight_decay``.
    """
    for p, u in zip(params, updates):
        if decay == 1.0:
            p.add_(u)
        else:
            torch.add(u, p, alpha=decay, out=p)


# Matrices per batched Newton-Schulz call are capped at this many stacked elements (a 256 MiB
# bf16 copy) so that a model with hundreds of large matrices does not double its memory.
_BATCH_ELEMS = 1 << 27


def largest_first(same: dict[tuple, list], numel) -> list[tuple[tuple, list]]:
    """The ``(key, items)`` groups of ``same`` by total size, largest first; ``numel(item)``
    gives one item's element count.

    Why: the step starts right after the host has synchronised on the gradient norm, and small
    matrices cost the GPU less than the host spends launching their kernels. Starting with the
    long Newton-Schulz GEMMs of the big stacks lets the host get ahead, so the GPU does not wait
    on launches for the small ones (measured: see benchmarks/README.md).
    """
    return sorted(same.items(), key=lambda kv: -sum(numel(x) for x in kv[1]))


def _batches(items: list, numel: int) -> list[list]:
    """``items`` (each standing for one matrix of ``numel`` elements) in runs of at most
    ``_BATCH_ELEMS`` stacked elements."""
    per = max(1, _BATCH_ELEMS // numel)
    return [items[i:i + per] for i in range(0, len(items), per)]


class Muon(torch.optim.Optimizer):
    """Muon for 2-D weights ``[A, B]`` and stacks ``[S, A, B]``; see the module docstring.

    Group options: ``lr``, ``weight_decay``, ``momentum`` (0.95), ``nesterov`` (True),
    ``ns_steps`` (5) and ``heads``: None (whole matrix), an int (every parameter of the group
    split into that many row blocks) or a list with one entry (None or int) per parameter.
    Parameters may be given as ``(name, tensor)`` pairs (torch keeps them in
    ``group["param_names"]``); names then appear in error messages. State per parameter is
    ``momentum_buffer`` (same shape as the parameter; its dtype is ``state_dtype``, None: the
    parameter's, e.g. ``torch.bfloat16`` for bf16 momentum). ``ns_mode``: the Newton-Schulz
    form, "standard", "gram" or "auto" (``optim.ns_gram``; the same map, other FLOPs).

    ``tp_group``: the tensor-parallel group (None: no TP). TP-sharded parameters whose blocks
    straddle the shards (``tp_shard``) are then orthogonalised whole: each step all-gathers
    their Newton-Schulz inputs over it, so every rank of the group must step together. The
    state stays this rank's shard.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        heads: int | None = None,
        state_dtype: torch.dtype | None = None,
        ns_mode: NSMode = "standard",
        tp_group: Any = None,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Muon: lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: momentum must be in [0, 1), got {momentum}")
        if ns_steps < 1:
            raise ValueError(f"Muon: ns_steps must be >= 1, got {ns_steps}")
        if ns_mode not in NS_MODES:
            raise ValueError(f"Muon: ns_mode must be one of {', '.join(NS_MODES)}, got {ns_mode!r}")
        # An attribute, not a group option: torch's load_state_dict restores group options from
        # the checkpoint, and the Newton-Schulz form is the run's choice, not the checkpoint's.
        self.ns_mode = ns_mode
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                        nesterov=nesterov, ns_steps=ns_steps, heads=heads, state_dtype=state_dtype)
        super().__init__(params, defaults)
        self._tp_group = tp_group

    @staticmethod
    def _per_param(group: dict[str, Any]) -> list[tuple[torch.Tensor, str | None, int | None]]:
        params = group["params"]
        names = group.get("param_names") or [None] * len(params)
        heads = group["heads"]
        if isinstance(heads, (list, tuple)):
            if len(heads) != len(params):
                raise ValueError(f"Muon: group has {len(params)} params but {len(heads)} heads")
        else:
            heads = [heads] * len(params)
        return list(zip(params, names, heads))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        # Check shapes now so a misconfigured table fails at build time, not at step 1; a
        # rejected group is removed so a caller that catches the error keeps a sound optimizer.
        try:
            for p, name, heads in self._per_param(self.param_groups[-1]):
                _check_matrix(tuple(p.shape), heads, name)
        except ValueError:
            self.param_groups.pop()
            raise

    def _update_batches(self, group: dict[str, Any], only: set[int] | None = None
                        ) -> list[tuple[int | None, TPShard | None, list[torch.Tensor]]]:
        """``(heads, tp, params)`` per Newton-Schulz call of ``step`` for ``group``: parameters
        with a gradient (and, given ``only``, whose id is in it), batched by shape, head split,
        TP split (``tp_shard``), dtype and device, largest first. The same on every TP rank
        (their shards have the same shapes), so the TP all-gathers pair up."""
        same: dict[tuple, list[torch.Tensor]] = {}
        for p, _name, heads in self._per_param(group):
            if p.grad is not None and (only is None or id(p) in only):
                tp = tp_shard(p, heads, self._tp_group)
                same.setdefault((tuple(p.shape), heads, tp, p.dtype, p.grad.dtype, p.device), []).append(p)
        # A TP-split batch holds whole matrices W times its shards: cap by the whole size.
        return [(heads, tp, ps) for (_shape, heads, tp, *_), params in largest_first(same, torch.Tensor.numel)
                for ps in _batches(params, params[0].numel() * (tp.world if tp else 1))]

    def momentum_buffer(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """``p``'s momentum (``[*p.shape]`` in the group's ``state_dtype``), zeros at first use."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=group.get("state_dtype") or p.dtype,
                                                        memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # torch casts the state to the parameters' dtype
        for group in self.param_groups:
            for p in group["params"]:
                buf = self.state.get(p, {}).get("momentum_buffer")
                if buf is not None and group.get("state_dtype") not in (None, buf.dtype):
                    self.state[p]["momentum_buffer"] = buf.to(group["state_dtype"])

    def _step_group(self, group: dict[str, Any], only: set[int] | None = None) -> None:
        """The update of ``group``'s parameters with a gradient (those in ``only``, if given)."""
        lr, wd = group["lr"], group["weight_decay"]
        for heads, tp, ps in self._update_batches(group, only):
            for p in ps:
                self.momentum_buffer(p, group)
            updates = muon_updates(
                [p.grad for p in ps], [self.state[p]["momentum_buffer"] for p in ps],
                momentum=group["momentum"], nesterov=group["nesterov"], heads=heads,
                ns_steps=group["ns_steps"], alpha=-lr, ns_mode=self.ns_mode, tp=tp)
            apply_muon_updates(ps, updates, 1.0 - lr * wd)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    @torch.no_grad()
    def warm_kernels(self) -> None:
        """Launch the kernels of the next ``step()`` (momentum pass, Newton-Schulz GEMMs) on
        scratch tensors of every shape and batch it will use; no parameter, gradient or state
        changes. See ``scratch_muon_updates``."""
        for group in self.param_groups:
            for heads, tp, ps in self._update_batches(group):
                scratch_muon_updates([p.grad for p in ps], ps, momentum=group["momentum"],
                                     nesterov=group["nesterov"], heads=heads, ns_steps=group["ns_steps"],
                                     alpha=-group["lr"], ns_mode=self.ns_mode, tp=tp and tp.scratch())
