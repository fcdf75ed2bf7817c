"""train.threads: one rule for every command, against the arithmetic written out."""
import torch

from k3train.runtime import threads


def test_auto_divides_the_cores_among_local_processes():
    assert threads.threads_for(0, 1, 16) == 16 and threads.threads_for(0, 4, 16) == 4
    assert threads.threads_for(0, 8, 2) == 1          # never zero
    assert threads.threads_for(3, 8, 2) == 3          # an explicit count is exactly that


def test_apply_follows_torchrun_local_size_and_keeps_a_users_omp(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setattr(threads, "cores_available", lambda: 4)
        assert threads.apply_threads(0) == 2 and torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        assert threads.apply_threads(0) == 1           # the user's setting stands
        assert threads.apply_threads(3) == 3 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
