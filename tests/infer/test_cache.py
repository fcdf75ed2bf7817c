"""The cached incremental forward equals the full forward at every position (fp64, CPU)."""
import pytest
import torch

from k3train.runtime.distributed import init_distributed, shutdown_distributed
from k3train.infer.cache import CachedModel, cache_bytes_per_token
from k3train.infer.sampling import sample_tokens
from k3train.model.model import build_model
from tests.helpers import small_cfg


@pytest.fixture(params=["channel", "head"], ids=["kda_gate", "head_gate"])
def model64(request):
    init_distributed()
    try:
        # KDA chunks of 8 tokens: a 21-token prompt and its continuation cross several chunk
        # boundaries, both inside the prefill and during decode. Block AttnRes on, MoE layers on.
        # Both forget gates: KDA's per channel and the per-head (Gated DeltaNet) one.
        model = build_model(small_cfg("model.kda.chunk_size=8", "moe.dispatcher=local",
                                 f"model.kda.gate={request.param}")).double().eval()
        yield model
    finally:
        shutdown_distributed()


@pytest.mark.slow
@pytest.mark.parametrize("prefill", [1, 5, 13])
def test_incremental_logits_equal_the_full_forward(model64, prefill):
    torch.manual_seed(0)
    tokens = torch.randint(0, 257, (2, 21))
    with torch.no_grad():
        full = model64(tokens)  # [B, T, vocab], chunked KDA and causal SDPA
    cached = CachedModel(model64)
    parts = [cached(tokens[:, :prefill])] + [cached(tokens[:, t:t + 1]) for t in range(prefill, tokens.shape[1])]
    step = torch.cat(parts, dim=1)
    torch.testing.assert_close(step, full, rtol=1e-10, atol=1e-10)
    assert cached.length == tokens.shape[1]

    # The cache: the KDA state and conv tails stay constant; the MLA latent grows by rank + rope per token.
    m = model64.layers[3].mixer
    assert m.cache["c"].shape == (2, 21, m.inner.kv_rank) and m.cache["k_rope"].shape == (2, 21, m.inner.rope)
    k = model64.layers[0].mixer
    assert k.cache["S"].shape == (2, k.inner.num_heads, k.inner.head_dim, k.inner.head_dim)
    sizes = cache_bytes_per_token(model64)
    a = m.inner
    assert sizes["mla_latent_bytes_per_token"] == 2 * (a.kv_rank + a.rope)  # one MLA layer of 4, bf16
    assert sizes["mla_full_kv_bytes_per_token"] == 2 * a.num_heads * (a.nope + a.rope + a.v_dim)


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seed = torch.tensor(0)
    draws = {int(sample_tokens(logits, 1.0, 0.7, seed, torch.tensor(i))) for i in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    assert int(sample_tokens(logits, 0.0, 1.0, seed, torch.tensor(0))) == 0  # greedy


@pytest.mark.slow
def test_generate_command_greedy_equals_argmax_of_full_forwards(tmp_path, capsys, monkeypatch):
    """``k3train generate --temperature 0`` from a checkpoint: each new token is the argmax of a
    full (uncached) forward over everything so far."""
    from k3train.cli import main as cli_main
    from k3train.trainer.checkpoint import latest_checkpoint
    from k3train.trainer.loop import train
    from k3train.trainer.state_io import consolidated_state

    train(small_cfg("train.steps=1"), tmp_path)
    capsys.readouterr()
    assert cli_main(["generate", "--checkpoint", str(tmp_path / "checkpoints"), "--prompt", "The quick",
                     "--max-new-tokens", "6", "--temperature", "0", "--device", "cpu"]) == 0
    text = capsys.readouterr().out.rstrip("\n")
    init_distributed()
    try:
        model = build_model(small_cfg("moe.dispatcher=local")).eval()
        model.load_state_dict(consolidated_state(latest_checkpoint(tmp_path / "checkpoints"))["model"], strict=False)
        ids = list(b"The quick")
        with torch.no_grad():
            for _ in range(6):
                ids.append(int(model(torch.tensor([ids]))[0, -1, :257].argmax()))  # byte vocabulary
    finally:
        shutdown_distributed()
    want = bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")  # EOD (256) dropped
    assert text == want
    # Where Triton kernels run, a compile-ahead pass (here with real arithmetic, as on CPU it
    # is) goes first and must leave the generated text unchanged.
    from k3train.ops import kernels
    from k3train.ops import triton_compile

    passes = []
    monkeypatch.setattr(kernels, "uses_triton", lambda device: True)
    monkeypatch.setattr(triton_compile, "compile_ahead", lambda fn, label="": passes.append(fn()) or {})
    assert cli_main(["generate", "--checkpoint", str(tmp_path / "checkpoints"), "--prompt", "The quick",
                     "--max-new-tokens", "6", "--temperature", "0", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == want and len(passes) == 1 and len(passes[0][0][0]) == 2
    # A batch of two prompts of different lengths: the first sample is the text above, the
    # banner says the graph is off (CPU).
    assert cli_main(["generate", "--checkpoint", str(tmp_path / "checkpoints"), "--prompt", "The quick",
                     "--prompt", "A", "--max-new-tokens", "6", "--temperature", "0", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    samples = captured.out.split("=== sample 1 ===\n")
    assert samples[0] == "=== sample 0 ===\n" + want + "\n" and samples[1].startswith("A")
    assert "CUDA graph off (auto: cpu has no CUDA graphs)" in captured.err
    assert cli_main(["generate", "--checkpoint", str(tmp_path / "checkpoints"), "--prompt", "x",
                     "--top-p", "0"]) == 2
    assert "--top-p 0" in capsys.readouterr().err
