"""P = 1 runs the engine's code path without communication (hops are local hand-overs)."""
import pytest
import torch

from pipeline import CommRecorder, PipelineEngine, PipelineLayout, StageIO
from tests.pipeline.toy_model import build_chunks, make_batch, reference

RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.parametrize("transport,attnres", [("cached", True), ("naive", True), ("cached", False)],
                         ids=["cached", "naive", "standard"])
@pytest.mark.parametrize("vpp", [1, 4])
def test_single_rank_matches_reference(transport, attnres, vpp):
    """vpp=1 is one chunk, first and last (the engine-overhead benchmark's V=1)."""
    layout = PipelineLayout(8, pp_size=1, vpp_size=vpp)
    chunks, produced = build_chunks(layout, attnres)
    mbs = make_batch(3)
    ref_loss, ref_grads = reference(chunks, mbs)
    rec = CommRecorder()
    engine = PipelineEngine(local_chunks=dict(enumerate(chunks)), num_chunks=vpp, produced_blocks=produced,
                            transport=transport, recorder=rec)
    for _step in range(2):     # the second step reuses what the first learnt (droppable outputs)
        for ch in chunks:
            ch.zero_grad(set_to_none=True)
        loss = engine.train_step(mbs)
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
        for c, ch in enumerate(chunks):
            for n, p in ch.named_parameters():
                torch.testing.assert_close(p.grad, ref_grads[c][n], rtol=RTOL, atol=ATOL)
    table = rec.bytes_table()
    assert table["measured_fwd"] == table["predicted_fwd"]
    if not attnres and vpp > 1:   # the residual stream's final add is saved by nothing: dropped
        assert engine.deallocated_outputs > 0
    if transport == "cached" and attnres and vpp > 1:
        assert engine.peak_cache_bytes > 0
    torch.testing.assert_close(engine.eval_step(mbs), ref_loss, rtol=RTOL, atol=ATOL)


def test_wrong_chunks_and_missing_blocks():
    layout = PipelineLayout(4, pp_size=1, vpp_size=2)
    chunks, produced = build_chunks(layout)
    with pytest.raises(ValueError, match="must hold chunks"):
        PipelineEngine(local_chunks={0: chunks[0]}, num_chunks=2, produced_blocks=produced)

    class Forgetful(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            out = self.inner(x)
            return StageIO(out.hidden, {})

    engine = PipelineEngine(local_chunks={0: Forgetful(chunks[0]), 1: chunks[1]}, num_chunks=2,
                            produced_blocks=produced)
    with pytest.raises(KeyError, match="lacks blocks"):
        engine.train_step(make_batch(1))
