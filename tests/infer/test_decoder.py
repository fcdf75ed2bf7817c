"""The static-buffer decode step (``k3train.infer.decoder``) against the growing-cache eager decode
it replaces, the device sampler, and the graph wrapper's capture logic with a fake capture (CPU).

Reference: ``CachedModel``'s growing-cache forward fed one token at a time (the decode
``k3train generate`` ran before the static buffers), greedy, 64 tokens; tolerances 1e-12 in
fp64 and 1e-6 in fp32 on the logits, tokens equal."""
import pytest
import torch

from k3train.infer import decoder as decoder_mod
from k3train.infer.cache import CachedModel
from k3train.infer.decoder import Decoder, bind
from k3train.infer.sampling import sample_tokens, uniform_noise
from k3train.model.model import build_model
from k3train.runtime.distributed import init_distributed, shutdown_distributed
from tests.helpers import small_cfg

VOCAB = 257  # the byte tokenizer's ids (the model pads beyond)


def _model(dtype):
    # KDA chunks of 8: prompts of 5, 13 and 21 tokens end inside different chunks. AttnRes and
    # MoE layers on, as in k3_tiny.
    return build_model(small_cfg("model.kda.chunk_size=8", "moe.dispatcher=local")).to(dtype).eval()


_BUILT: dict = {}  # dtype -> CachedModel: built once for the module (a build takes a second)


@pytest.fixture
def models():
    """dtype -> the CachedModel in that dtype (same weights); the one-rank groups its
    linears need are set up for each test (conftest tears them down after each)."""
    init_distributed()

    def get(dtype):
        if dtype not in _BUILT:
            _BUILT[dtype] = CachedModel(_model(dtype))
        return _BUILT[dtype]

    try:
        yield get
    finally:
        shutdown_distributed()


@pytest.fixture
def cached64(models):
    return models(torch.float64)


@torch.no_grad()
def eager_reference(cached, prompts: torch.Tensor, n: int):
    """The growing-cache decode: greedy tokens [B, n] and the logits [n, B, vocab] they came from."""
    bind(cached, None)
    cached.reset()
    logits = cached(prompts)[:, -1, :VOCAB]
    tokens, kept = [], []
    for i in range(n):
        kept.append(logits)
        nxt = logits.argmax(-1)
        tokens.append(nxt)
        if i + 1 < n:
            logits = cached(nxt[:, None])[:, -1, :VOCAB]
    return torch.stack(tokens, 1), torch.stack(kept)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


FP64, FP32 = (torch.float64, 1e-12), (torch.float32, 1e-6)


@pytest.mark.parametrize("dtype, tol, lengths", [
    (*FP64, [13]), (*FP64, [5, 13, 21]),
    pytest.param(*FP64, [13, 13, 13], marks=pytest.mark.slow),
    pytest.param(*FP32, [13], marks=pytest.mark.slow),
    pytest.param(*FP32, [13, 13, 13], marks=pytest.mark.slow),
    pytest.param(*FP32, [5, 13, 21], marks=pytest.mark.slow),
], ids=["fp64-b1", "fp64-b3_ragged", "fp64-b3", "fp32-b1", "fp32-b3", "fp32-b3_ragged"])
def test_static_step_equals_the_growing_cache_decode(models, dtype, tol, lengths):
    cached = models(dtype)
    prompts = _prompts(lengths)
    n = 64
    dec = Decoder(cached, vocab=VOCAB, cuda_graph=False)
    kept: list[torch.Tensor] = []
    ids, timing = dec.generate(prompts, n, temperature=0.0, keep_logits=kept)
    got_logits = torch.stack(kept)  # [n, B, vocab]
    assert len(ids) == len(lengths) and all(len(row) == n for row in ids)
    if len(set(lengths)) == 1:  # one batched reference
        want_ids, want_logits = eager_reference(cached, torch.tensor(prompts), n)
    else:  # the growing cache takes one length per batch: each row alone
        parts = [eager_reference(cached, torch.tensor([p]), n) for p in prompts]
        want_ids, want_logits = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts], 1)
    assert ids == want_ids.tolist()
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=tol)
    assert timing["cuda_graph"] is False


def test_buffers_are_updated_in_place_and_reused(cached64):
    """Every step writes the same tensors (what a captured graph reads and writes), and a second
    call of the same batch size reuses them; the slots past each row's position stay zero."""
    dec = Decoder(cached64, vocab=VOCAB)
    prompts = _prompts([3, 7])
    dec.generate(prompts, 4)
    buf = dec.buffers[2]
    tensors = [buf.token, buf.pos, buf.logits, buf.seed, buf.counter,
               *(t for layer in buf.layers if layer for t in layer.values())]
    ptrs = [t.data_ptr() for t in tensors]
    dec.generate(prompts, 9)
    assert dec.buffers[2] is buf and [t.data_ptr() for t in tensors] == ptrs
    assert buf.pos.tolist() == [3 + 8, 7 + 8]  # prompt + fed tokens
    mla = [layer for layer in buf.layers if layer and "c" in layer][0]
    assert mla["c"].shape[1] == decoder_mod.LENGTH_STEP
    assert mla["c"][0, 11:].abs().max() == 0 and mla["c"][0, 10].abs().max() > 0  # slots 0..10 hold tokens


def test_sampling_with_a_seed_is_reproducible(cached64):
    prompts = _prompts([4, 9, 9])
    dec = Decoder(cached64, vocab=VOCAB)
    a, _ = dec.generate(prompts, 24, temperature=1.0, top_p=0.9, seed=7)
    b, _ = dec.generate(prompts, 24, temperature=1.0, top_p=0.9, seed=7)
    c, _ = dec.generate(prompts, 24, temperature=1.0, top_p=0.9, seed=8)
    assert a == b and a != c
    assert a[1] != a[2]  # equal prompts, independent samples (the noise depends on the row)


def test_sampler_draws_from_the_softmax_and_is_keyed_by_seed_and_counter():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).expand(40_000, 4)
    seed, counter = torch.tensor(3), torch.tensor(11)
    draws = sample_tokens(logits, 1.0, 1.0, seed, counter)
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    # 40k draws: the standard error of each frequency is below 0.0025.
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64), rtol=0, atol=0.01)
    # temperature 2 flattens: p ~ sqrt(p0)
    flat = torch.tensor([0.5, 0.3, 0.15, 0.05]).sqrt()
    freq2 = torch.bincount(sample_tokens(logits, 2.0, 1.0, seed, counter), minlength=4).double() / 40_000
    torch.testing.assert_close(freq2, (flat / flat.sum()).double(), rtol=0, atol=0.01)
    # top-p 0.7 keeps the two most probable tokens, renormalised: 0.5/0.8, 0.3/0.8
    freq3 = torch.bincount(sample_tokens(logits, 1.0, 0.7, seed, counter), minlength=4).double() / 40_000
    torch.testing.assert_close(freq3, torch.tensor([0.625, 0.375, 0, 0], dtype=torch.float64), rtol=0, atol=0.01)
    u = uniform_noise((2, 5), seed, counter)
    assert torch.equal(u, uniform_noise((2, 5), seed.clone(), counter.clone()))
    assert not torch.equal(u, uniform_noise((2, 5), seed, counter + 1))
    assert not torch.equal(u, uniform_noise((2, 5), seed + 1, counter))
    assert 0 < u.min() and u.max() < 1


class FakeGraphs:
    """Stands in for ``CudaGraphs`` on CPU: a warm-up runs the step; a capture records it
    without running it (as a CUDA capture records kernels without running them); a replay
    runs what was recorded."""

    def __init__(self):
        self.warmups = self.replays = 0
        self.captured: list = []

    def warm(self, step):
        self.warmups += 1
        step()

    def capture(self, step):
        self.captured.append(step)
        fake = self

        class Graph:
            def replay(self):
                fake.replays += 1
                step()

        return Graph()


def test_graph_wrapper_captures_after_warmup_per_batch_size(cached64, monkeypatch):
    monkeypatch.setattr(decoder_mod, "LENGTH_STEP", 16)
    fake = FakeGraphs()
    dec = Decoder(cached64, vocab=VOCAB, cuda_graph=True, warmup=2, graphs=fake)
    eager = Decoder(cached64, vocab=VOCAB, cuda_graph=False)
    one, three = _prompts([6]), _prompts([6, 2, 9], seed=1)

    # 8 tokens: 1 sampled after prefill, then 7 steps: 2 warm-ups, a capture and 5 replays.
    assert dec.generate(one, 8, temperature=0.9, seed=1)[0] == eager.generate(one, 8, temperature=0.9, seed=1)[0]
    assert (fake.warmups, len(fake.captured), fake.replays) == (2, 1, 5)
    # Another batch size: its own warm-up and capture; the first graph stays.
    assert dec.generate(three, 5)[0] == eager.generate(three, 5)[0]
    assert (fake.warmups, len(fake.captured), fake.replays) == (4, 2, 7)
    assert len(dec.graphed.graphs) == 2
    # Back to batch 1: replays only, on the same buffers, refilled by the new prefill.
    assert dec.generate(one, 8, temperature=0.9, seed=2)[0] == eager.generate(one, 8, temperature=0.9, seed=2)[0]
    assert (fake.warmups, len(fake.captured), fake.replays) == (4, 2, 14)
    # A longer call outgrows batch 1's buffers (16 slots): new buffers, every graph dropped,
    # warm-up and capture again.
    assert dec.generate(one, 20)[0] == eager.generate(one, 20)[0]
    assert dec.buffers[1].max_len == 32 and len(fake.captured) == 3 and len(dec.graphed.graphs) == 1
    # Graphs off: every step eager, nothing captured.
    off = FakeGraphs()
    Decoder(cached64, vocab=VOCAB, cuda_graph=False, graphs=off).generate(one, 5)
    assert (off.warmups, len(off.captured), off.replays) == (0, 0, 0)


def test_the_step_reads_nothing_on_the_host(models, monkeypatch):
    """What a CUDA capture forbids, checked on CPU in fp32 (the dtype and MoE path CUDA takes:
    the grouped GEMM, not the per-expert loop that reads counts on the host): no op of the step
    reads a tensor's value on the host (``.item()``, ``nonzero``, data-dependent shapes)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moe.experts import GroupedExperts

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.reads: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if any(s in name for s in ("_local_scalar_dense", "nonzero", "masked_select", "unique", "bincount")):
                self.reads.append(name)
            return func(*args, **(kwargs or {}))

    def loop(*args, **kwargs):
        raise AssertionError("the per-expert loop (host read of the counts) ran")

    monkeypatch.setattr(GroupedExperts, "forward_loop", loop)
    dec = Decoder(models(torch.float32), vocab=VOCAB)
    for temperature, top_p in ((0.0, 1.0), (0.8, 0.9)):
        buf = dec.prefill(_prompts([4, 6]), 16)
        with torch.no_grad(), HostReads() as mode:
            dec._step(buf, temperature, top_p)
        assert mode.reads == []
        assert buf.pos.tolist() == [5, 7]


@pytest.mark.slow
def test_compiled_step_decodes_as_the_eager_step(cached64):
    """``compile_step``: the step's model call traced by dynamo (the ``aot_eager`` backend, so
    no C++ toolchain is needed; inductor fuses the same graph on the GPU) decodes the same greedy
    tokens with the same logits (fp64, 1e-12), and its in-place buffer updates (the KDA state, the
    conv tails, the latent slots) land in the same static tensors."""
    torch._dynamo.reset()
    prompts = _prompts([5, 13])
    ref_logits, out_logits = [], []
    ids_ref, _ = Decoder(cached64, vocab=VOCAB).generate(prompts, 6, keep_logits=ref_logits)
    dec = Decoder(cached64, vocab=VOCAB, compile_step="aot_eager")
    ids, _ = dec.generate(prompts, 6, keep_logits=out_logits)
    assert ids == ids_ref
    torch.testing.assert_close(torch.stack(out_logits), torch.stack(ref_logits), rtol=0, atol=1e-12)
    assert dec.buffers[2].pos.tolist() == [5 + 5, 13 + 5]
