"""SiTU-GLU experts: all local experts in one grouped GEMM, plus a dense SiTU-GLU MLP.

``torch._grouped_mm(a [M, K], b [G, K, N], offs=[G] int32)`` multiplies row block
``a[offs[g-1]:offs[g]]`` by ``b[g]``. Measured on CPU in torch 2.13 (forward and backward):
  * dtypes float32, bfloat16, float16, both operands the same dtype; float64 is rejected;
  * ``offs`` must be int32 (cumulative end offsets, last one = M);
  * the non-unit stride of every operand must be a multiple of 16 bytes, i.e. ``K`` and ``N``
    times the element size must be multiples of 16 (fp32: multiples of 4; bf16: of 8);
  * empty groups (repeated offsets) and ``M == 0`` are allowed and give the right result;
  * backward applies the stride rules to the output gradient too (see ``_ContiguousGrad``).
On one H200 with torch 2.11 the same rules held for fp32/bf16/fp16 (checked once, with empty
groups and M == 0). The 16-byte base-pointer check is ours (CUDA kernels load 16-byte vectors).
Inputs outside these rules (fp64 reference tests, odd widths) take the per-expert loop, which
needs the counts on the host (a device sync on GPU). Under autocast both operands are cast to
the autocast dtype first (``_grouped_mm`` has no autocast rule), as for any Linear.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .activations import DEFAULT_BETA, DEFAULT_BETA_LIN, situ_glu
from .group_pad import pad_groups
from .norm import autocast_dtype

_GMM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _aligned_2d(t: torch.Tensor) -> bool:
    """Unit stride in the last dim, 16-byte row stride and 16-byte base pointer."""
    size = t.element_size()
    return (t.stride(-1) == 1 and (t.stride(-2) * size) % 16 == 0
            and t.data_ptr() % 16 == 0)


def grouped_mm_supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm(a [M, K], b [G, K, N], offs)`` accepts these operands."""
    if a.is_cuda and a.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        # Under torch.compile on CUDA, _grouped_mm's fake-tensor rule (torch 2.11) accepts bf16
        # only, though the eager CUDA kernel runs fp32: an fp32 compiled step (the compiled
        # decode check's exact reference, scripts/gpu_check_compiled_decode.py) failed to trace
        # on an H200 (2026-12-04). Such operands take the per-expert loop.
        return False
    return (a.dtype == b.dtype and a.dtype in _GMM_DTYPES and a.device == b.device
            and _aligned_2d(a) and _aligned_2d(b))


# forward_gathered holds every row's weights at once: only for a few rows (decode steps).
_GATHER_MAX_BYTES = 256 * 2**20


def _gathered_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``forward_gathered``'s per-row weights (``[M, in, ffn]``) stay small."""
    return x.shape[0] * w[0].numel() * w.element_size() <= _GATHER_MAX_BYTES


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    ``_grouped_mm``'s backward applies the same stride rules to the output gradient, and
    common losses hand it a stride-0 expanded gradient (``y.sum().backward()`` fails with
    "Invalid strides/sizes" on CPU and CUDA otherwise).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class GroupedExperts(nn.Module):
    """``E`` SiTU-GLU experts ``y = (SiTU(x Wg) * cap(x Wu)) Wd`` over expert-sorted tokens.

    Weights: ``w_gate [E, in, ffn]``, ``w_up [E, in, ffn]``, ``w_down [E, ffn, in]``.
    Init is normal(0, init_std); ``down_std`` (default ``init_std``) lets a model scale the
    output projection, e.g. by 1/sqrt(2 * num_layers).

    Optional quantisation hooks (e.g. MX fake-quant for QAT), given at build time; both default
    to None (full precision). This library does not know any number format: the caller owns it.
      * ``weight_quant(w [E, K, N]) -> [E, K, N]``: applied to each stacked weight as it is
        used, ``x_e @ w[e]``; K (dim 1) is the reduction dim, so block formats block along K
        (``in`` for w_gate/w_up, ``ffn`` for w_down).
      * ``act_quant(x [M, K]) -> [M, K]``: applied to the input of each grouped GEMM (the
        expert input and the SiTU-GLU output); blocks run along the last (reduction) dim.
    Both must be differentiable (e.g. straight-through) when training.
      * ``grouped_gemm(x [M, K], w [G, K, N], offs [G] int32) -> [M, N]``: replaces
        ``torch._grouped_mm`` for the three expert GEMMs (e.g. an FP8 grouped GEMM). It gets
        x in the compute dtype (the autocast dtype under autocast) and the weight as stored, and
        casts the weight itself (so a cast and a layout change can be one copy). An attribute
        ``group_alignment`` (default 1) asks for every group padded with zero rows to a
        multiple of that many rows (``moe.group_pad``, no host sync).
    """

    def __init__(self, num_experts: int, in_size: int, ffn_size: int, *,
                 init_std: float = 0.02, down_std: float | None = None,
                 beta: float = DEFAULT_BETA, beta_lin: float = DEFAULT_BETA_LIN,
                 weight_quant: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 act_quant: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 grouped_gemm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 expert_offset: int = 0, total_experts: int | None = None):
        super().__init__()
        # Expert parallelism: this module holds experts [offset, offset + num_experts) of
        # ``total_experts``; init draws all of them so any EP size gives the same model.
        self.expert_offset = expert_offset
        self.total_experts = num_experts if total_experts is None else total_experts
        self.weight_quant, self.act_quant = weight_quant, act_quant
        self.grouped_gemm = grouped_gemm
        self.num_experts, self.in_size, self.ffn_size = num_experts, in_size, ffn_size
        self.init_std = init_std
        self.down_std = init_std if down_std is None else down_std
        self.beta, self.beta_lin = beta, beta_lin
        self.w_gate = nn.Parameter(torch.empty(num_experts, in_size, ffn_size))
        self.w_up = nn.Parameter(torch.empty(num_experts, in_size, ffn_size))
        self.w_down = nn.Parameter(torch.empty(num_experts, ffn_size, in_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # Fixed order so that a given torch.manual_seed always gives the same experts; the full
        # [total_experts, ...] tensors are drawn (O(total) memory at init only) and sliced.
        # Holding every expert (no EP), the draw goes straight into the parameter: the same
        # numbers (same generator, same count, same order) without a second full-size tensor
        # and its copy (k3_mini builds in ~16 s on two CPU cores instead of ~18).
        lo, hi = self.expert_offset, self.expert_offset + self.num_experts
        with torch.no_grad():
            for w, std in ((self.w_gate, self.init_std), (self.w_up, self.init_std),
                           (self.w_down, self.down_std)):
                if self.num_experts == self.total_experts and w.is_contiguous():
                    nn.init.normal_(w, std=std)
                    continue
                full = torch.empty((self.total_experts, *w.shape[1:]), dtype=w.dtype, device=w.device)
                w.copy_(nn.init.normal_(full, std=std)[lo:hi])

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w_gate, w_up, w_down) as the GEMMs use them: through ``weight_quant`` if set."""
        if self.weight_quant is None:
            return self.w_gate, self.w_up, self.w_down
        # A quantiser that blocks along dim 1 may return a transposed view; _grouped_mm needs
        # unit stride in the last dim, so make it contiguous (a copy only when needed).
        return tuple(self.weight_quant(w).contiguous() for w in (self.w_gate, self.w_up, self.w_down))

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.act_quant is None else self.act_quant(x)

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x_sorted: ``[M, in]`` rows grouped by expert (expert 0 first);
        tokens_per_expert: ``[E]`` integer counts summing to M. Returns ``[M, in]``."""
        w_gate, w_up, w_down = self._weights()
        x = self._act(x_sorted)
        cast = autocast_dtype(x)
        if self.grouped_gemm is not None:
            return self._forward_hook(x if cast is None else x.to(cast), (w_gate, w_up, w_down),
                                      tokens_per_expert)
        if cast is not None:
            # torch._grouped_mm has no autocast rule: cast both operands as autocast casts a
            # Linear's, else bf16 activations meet fp32 master weights and every step takes the
            # per-expert loop with its host sync (measured: 8640 small GEMMs per k3_mini step).
            x, w_gate, w_up, w_down = (t.to(cast) for t in (x, w_gate, w_up, w_down))
        if not (grouped_mm_supported(x, w_gate) and grouped_mm_supported(x, w_down)):
            if x.is_cuda and torch.compiler.is_compiling() and _gathered_fits(x, w_gate):
                # The loop reads the counts on the host, which a CUDA graph cannot capture (the
                # fp32 compiled decode step, scripts/gpu_check_compiled_decode.py, 2026-12-04).
                return self.forward_gathered(x_sorted, tokens_per_expert)
            return self.forward_loop(x_sorted, tokens_per_expert)
        # Offsets stay on the device: no host sync on the grouped path.
        offs = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        gate = torch._grouped_mm(x, w_gate, offs=offs)
        up = torch._grouped_mm(x, w_up, offs=offs)
        h = self._act(situ_glu(gate, up, self.beta, self.beta_lin))
        return _ContiguousGrad.apply(torch._grouped_mm(h, w_down, offs=offs))

    def _forward_hook(self, x: torch.Tensor, weights: tuple[torch.Tensor, ...],
                      tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``forward`` through ``self.grouped_gemm``; x: ``[M, in]`` in the compute dtype."""
        gemm, (w_gate, w_up, w_down) = self.grouped_gemm, weights
        align = getattr(gemm, "group_alignment", 1)
        if align > 1:  # once for all three GEMMs: the zero rows stay zero through SiTU-GLU
            x, offs, rows = pad_groups(x, tokens_per_expert, align)
        else:
            offs = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        h = self._act(situ_glu(gemm(x, w_gate, offs), gemm(x, w_up, offs), self.beta, self.beta_lin))
        y = _ContiguousGrad.apply(gemm(h, w_down, offs))
        return y.index_select(0, rows) if align > 1 else y

    def forward_loop(self, x_sorted: torch.Tensor,
                     tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Per-expert loop with the same contract as ``forward``; the reference path and the
        fallback for operands ``torch._grouped_mm`` rejects. Reads the counts on the host.
        Applies ``weight_quant``/``act_quant`` but not ``grouped_gemm``."""
        w_gate, w_up, w_down = self._weights()
        # Activation blocks are per row, so quantising before the split equals quantising per expert.
        chunks = torch.split(self._act(x_sorted), tokens_per_expert.tolist(), dim=0)
        outs = []
        for e, xe in enumerate(chunks):
            h = situ_glu(xe @ w_gate[e], xe @ w_up[e], self.beta, self.beta_lin)
            outs.append(self._act(h) @ w_down[e])
        return torch.cat(outs, dim=0)

    def forward_gathered(self, x_sorted: torch.Tensor,
                         tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``forward``'s contract without a host read: each row's expert found on the device
        (``searchsorted`` over the offsets) and its weights gathered, ``[M, in, ffn]``, for one
        batched GEMM per projection. For the few rows of a decode step (``_gathered_fits``)
        where ``_grouped_mm`` refuses the dtype. Applies ``weight_quant``/``act_quant``."""
        w_gate, w_up, w_down = self._weights()
        x = self._act(x_sorted)
        offs = torch.cumsum(tokens_per_expert, dim=0)
        rows = torch.arange(x.shape[0], device=x.device, dtype=offs.dtype)
        expert = torch.searchsorted(offs, rows, right=True).clamp_max(w_gate.shape[0] - 1)
        xe = x.unsqueeze(1)                                          # [M, 1, in]
        h = situ_glu(torch.bmm(xe, w_gate[expert]), torch.bmm(xe, w_up[expert]), self.beta, self.beta_lin)
        return torch.bmm(self._act(h), w_down[expert]).squeeze(1)    # [M, in]

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, in={self.in_size}, ffn={self.ffn_size}"


class SiTUGLUMLP(nn.Module):
    """Dense SiTU-GLU MLP ``[..., d] -> [..., d]`` with intermediate size ``ffn_size``
    (gate_proj, up_proj: d -> ffn; down_proj: ffn -> d; no biases)."""

    def __init__(self, hidden_size: int, ffn_size: int, *, init_std: float = 0.02,
                 down_std: float | None = None, beta: float = DEFAULT_BETA,
                 beta_lin: float = DEFAULT_BETA_LIN):
        super().__init__()
        self.beta, self.beta_lin = beta, beta_lin
        self.gate_proj = nn.Linear(hidden_size, ffn_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, ffn_size, bias=False)
        self.down_proj = nn.Linear(ffn_size, hidden_size, bias=False)
        nn.init.normal_(self.gate_proj.weight, std=init_std)
        nn.init.normal_(self.up_proj.weight, std=init_std)
        nn.init.normal_(self.down_proj.weight, std=init_std if down_std is None else down_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = situ_glu(self.gate_proj(x), self.up_proj(x), self.beta, self.beta_lin)
        return self.down_proj(h)
