"""benchmarks/bench_engine_overhead.py's round order: a seeded shuffle per round, so that no
runner (the A/A control included) always steps first or always follows the same runner."""
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
from benchmarks.bench_engine_overhead import round_orders  # noqa: E402


def test_every_round_is_a_permutation_and_the_order_is_seeded():
    orders = round_orders(5, 14)
    assert len(orders) == 14 and all(sorted(o) == list(range(5)) for o in orders)
    assert round_orders(5, 14) == orders and round_orders(5, 14, seed=1) != orders


def test_no_runner_keeps_a_place_or_a_predecessor():
    orders = round_orders(5, 14)
    for runner in range(5):
        places = Counter(o.index(runner) for o in orders)
        before = Counter(o[o.index(runner) - 1] for o in orders if o.index(runner) > 0)
        assert len(places) >= 3, (runner, places)       # a rotation gives 5, a fixed order 1
        assert max(before.values()) < 0.75 * sum(before.values()), (runner, before)
    # the rotation it replaces kept runner 4 (the control) behind runner 3 whenever it was not first
    rotation = [list(range(5))[k % 5:] + list(range(5))[:k % 5] for k in range(14)]
    behind = Counter(o[o.index(4) - 1] for o in rotation if o.index(4) > 0)
    assert behind[3] == sum(behind.values())


def test_device_work_sums_kernels_launches_and_host_time():
    """device_work on hand-made profiler events: two kernels, three host events of which one is
    a launch; no CUDA events gives kernel_ms None."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from benchmarks.bench_engine_overhead import device_work

    def ev(name, dev, us):
        return SimpleNamespace(name=name, device_type=dev, self_cpu_time_total=us if dev == DeviceType.CPU else 0,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [ev("gemm", DeviceType.CUDA, 1500), ev("norm", DeviceType.CUDA, 250), ev("aten::mm", DeviceType.CPU, 40),
              ev("cudaLaunchKernel", DeviceType.CPU, 7), ev("cudaLaunchKernel", DeviceType.CPU, 5)]
    assert device_work(events) == {"kernel_ms": 1.75, "launches": 2, "host_ms": 0.052}
    assert device_work(events[2:])["kernel_ms"] is None
