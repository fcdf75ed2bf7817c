"""AdamW with its moments stored in a narrower dtype than the parameters (bf16 moments).

The update is torch's AdamW (``torch.optim.adamw.adamw``, the rule ``torch.optim.AdamW``
runs) computed in the parameters' dtype: the stored moments are widened, stepped, and rounded
back to the state dtype. With the state dtype equal to the parameters' the moments are
stepped in place, bit for bit as ``torch.optim.AdamW``'s single-tensor path.
"""
from __future__ import annotations

import torch
from torch.optim.adamw import adamw as torch_adamw

__all__ = ["NarrowStateAdamW", "adamw_update"]


def adamw_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                 exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], *, lr: float, beta1: float,
                 beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step of ``params`` (each any shape; ``grads``, ``exp_avgs``, ``exp_avg_sqs`` of
    the same shapes) in place; ``steps``: 0-dim float tensors, incremented here (bias correction).
    Moments in a narrower dtype than their parameter are updated in a widened copy."""
    wide_m = [m if m.dtype == p.dtype else m.to(p.dtype) for m, p in zip(exp_avgs, params)]
    wide_v = [v if v.dtype == p.dtype else v.to(p.dtype) for v, p in zip(exp_avg_sqs, params)]
    torch_adamw(params, grads, wide_m, wide_v, [], steps, amsgrad=False, beta1=beta1, beta2=beta2,
                lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)
    for stored, wide in zip(exp_avgs + exp_avg_sqs, wide_m + wide_v):
        if stored is not wide:
            stored.copy_(wide)  # rounded to the state dtype


class NarrowStateAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (decoupled weight decay, no amsgrad) whose ``exp_avg`` /
    ``exp_avg_sq`` are kept in ``state_dtype`` (e.g. bf16: 4 bytes of moments per parameter
    instead of 8). State keys and ``step`` are torch's, so checkpoints interchange."""

    state_kind = "AdamW"  # CombinedOptimizer's check: the state is torch AdamW's

    def __init__(self, params, *, state_dtype: torch.dtype, **kwargs) -> None:
        super().__init__(params, **{**kwargs, "fused": None, "foreach": False})
        self.state_dtype = state_dtype

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # torch casts the moments to the parameters' dtype
        for st in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    st[key] = st[key].to(self.state_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            for p in ps:
                st = self.state[p]
                if "exp_avg" not in st:
                    st["exp_avg"] = torch.zeros(p.shape, dtype=self.state_dtype, device=p.device)
                    st["exp_avg_sq"] = torch.zeros(p.shape, dtype=self.state_dtype, device=p.device)
                    st["step"] = torch.tensor(0.0)
            if not ps:
                continue
            beta1, beta2 = group["betas"]
            adamw_update(ps, [p.grad for p in ps], [self.state[p]["exp_avg"] for p in ps],
                         [self.state[p]["exp_avg_sq"] for p in ps], [self.state[p]["step"] for p in ps],
                         lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"])
        return loss
