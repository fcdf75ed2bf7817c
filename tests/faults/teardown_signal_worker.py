"""``k3train train`` that sends itself SIGTERM at the start of step STEP (the stop request) and
again, SIGTERM then SIGINT, inside the end-of-run plots (a repeated delivery during teardown).

    python tests/faults/teardown_signal_worker.py STEP train --config ...

The guard's repeat window is set to 0 s here, so the teardown's signals count as later,
separate requests: the case a window cannot cover (a scheduler re-sending after seconds).
"""
import os
import signal
import sys

from k3train import cli
from k3train.trainer import faults, loop, stop


def main() -> int:
    stop_step = int(sys.argv[1])
    crash, plots = faults.maybe_crash, loop.write_end_of_run_plots
    # (loop._SignalGuard: where the guard lived before it moved to stop.py, so that this worker
    # shows the old failure, exit -15, rather than an import error)
    guard = getattr(stop, "SignalGuard", None) or getattr(loop, "_SignalGuard")
    guard.REPEAT_S = 0.0

    def signal_at_step(step: int) -> None:
        if step == stop_step:
            os.kill(os.getpid(), signal.SIGTERM)
        crash(step)

    def plots_under_signals(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        print("[teardown-worker] signals sent during the end-of-run plots", flush=True)
        return plots(*args, **kwargs)

    faults.maybe_crash = signal_at_step  # loop.py calls it at the start of every step
    loop.write_end_of_run_plots = plots_under_signals
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
