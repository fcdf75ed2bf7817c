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


def test_output_dtypes_match_the_docstring():
    """RouterOutput's documented dtypes: fp32 scores and weights outside autocast, bf16 under
    bf16 autocast; the selection adds the fp32 bias, so it ranks ``scores.float() + bias``
    (reference: torch.topk on that sum, computed here independently)."""
    from moe.router import SigmoidTopKRouter

    torch.manual_seed(0)
    r = SigmoidTopKRouter(64, 16, 4)
    r.bias.copy_(torch.randn(16) * 1e-3)  # below bf16's resolution near the scores: fp32 decides
    x = torch.randn(256, 64)
    plain = r(x)
    assert plain.scores.dtype == plain.weights.dtype == plain.logits.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = r(x)
    assert out.scores.dtype == out.weights.dtype == out.logits.dtype == torch.bfloat16
    ref = torch.topk(out.scores.float() + r.bias, 4, dim=-1).indices
    assert torch.equal(out.indices, ref)
