"""The sigmoid top-k router under autocast."""
import torch


def test_autocast_logits_equal_the_explicit_upcast_path():
    """Under autocast the router skips casting x up (autocast would cast it back down): the
    logits must equal what ``F.linear(x.float(), w.float())`` gives under the same autocast,
    bit for bit; outside autocast they stay fp32."""
    import torch.nn.functional as F

    from moe.router import SigmoidTopKRouter

    torch.manual_seed(0)
    r = SigmoidTopKRouter(64, 16, 2)
    x = torch.randn(32, 64).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = r(x).logits
        ref = F.linear(x.float(), r.weight.float())
    assert torch.equal(got, ref)
    assert r(x).logits.dtype == torch.float32
