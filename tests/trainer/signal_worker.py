"""A torchrun worker for the stop-signal tests: ``k3train train`` where chosen ranks send
themselves SIGTERM at the start of chosen steps, as a preemption that reaches the ranks at
different moments would.

    torchrun ... tests/trainer/signal_worker.py RANK@STEP[,RANK@STEP...] train --config ...

Everything after the first argument goes to the k3train command line unchanged.
"""
import os
import signal
import sys

from k3train import cli
from k3train.trainer import faults


def main() -> int:
    plan = {int(r): int(s) for r, s in (item.split("@") for item in sys.argv[1].split(","))}
    my_step = plan.get(int(os.environ["RANK"]))
    crash = faults.maybe_crash

    def signal_then_crash_hook(step: int) -> None:
        if step == my_step:
            os.kill(os.getpid(), signal.SIGTERM)
        crash(step)

    faults.maybe_crash = signal_then_crash_hook  # loop.py calls it at the start of every step
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
