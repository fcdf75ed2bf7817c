"""HostBuffers: the snapshot's host tensors are copies, refilled in place by the next snapshot."""
import torch

from k3train.trainer.host_buffers import HostBuffers


def test_a_copy_is_its_own_storage_and_the_next_copy_refills_it():
    host = HostBuffers()
    w = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    first = host.copy("w", w)
    assert torch.equal(first, w) and first.data_ptr() != w.data_ptr()
    w.add_(100.0)  # the next step updates the live tensor in place
    assert torch.equal(first, torch.arange(12, dtype=torch.float64).reshape(3, 4))
    again = host.copy("w", w)
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, w)  # kept, refilled
    assert host.nbytes == 12 * 8


def test_a_new_shape_or_dtype_gets_a_new_buffer():
    host = HostBuffers()
    a = host.copy("x", torch.ones(4))
    b = host.copy("x", torch.ones(5))
    c = host.copy("x", torch.ones(5, dtype=torch.bfloat16))
    assert b.shape == (5,) and c.dtype == torch.bfloat16
    assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3
    assert host.nbytes == 5 * 2


def test_a_strided_view_is_copied_as_its_values():
    host = HostBuffers()
    base = torch.randn(6, 8, dtype=torch.float64)
    view = base[:, 2:5].t()  # non-contiguous, as a TP shard's piece can be
    out = host.copy("v", view)
    assert out.is_contiguous() and torch.equal(out, view)


def test_copy_tree_copies_tensors_and_deep_copies_the_rest():
    host = HostBuffers()
    loads = torch.tensor([1.0, 2.0])
    tree = {"counts": [loads, {"steps": [3, 4]}], "name": "moe"}
    out = host.copy_tree("moe_loads", tree)
    loads.zero_()
    tree["counts"][1]["steps"].append(5)
    assert torch.equal(out["counts"][0], torch.tensor([1.0, 2.0]))
    assert out["counts"][1] == {"steps": [3, 4]} and out["name"] == "moe"
    again = host.copy_tree("moe_loads", tree)
    assert again["counts"][0].data_ptr() == out["counts"][0].data_ptr()  # same key path, same buffer
