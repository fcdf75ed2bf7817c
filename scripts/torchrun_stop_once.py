"""torchrun whose agent acts on the first stop signal only; scripts/run_torchrun.sh runs it.
Same arguments as torchrun: ``python scripts/torchrun_stop_once.py TORCHRUN_ARGS...``.

Why: torchrun's agent turns SIGTERM, SIGINT, SIGHUP and SIGQUIT into a ``SignalException``
raised in its main thread (``torch.distributed.elastic.multiprocessing.api.
_terminate_process_handler``). ``SimpleElasticAgent.run`` catches it and calls ``_shutdown``,
which sends every worker a closing signal and waits up to TORCH_ELASTIC_SHUTDOWN_TIMEOUT for
them to save. A second signal raises the exception again inside that wait, before ``run`` has
set ``shutdown_called``: the teardown is abandoned halfway and ``run``'s ``finally`` starts a
second one, which sends every worker a second round of closing signals (one that lands 5 s or
more after a worker's first signal makes it abort without a checkpoint) and twice in CI left
the agent hanging after both workers had saved.

One stop request does reach the agent more than once: SLURM's --signal reaches every process
of a job step, the terminal's Ctrl-C every process of the foreground process group, and
run_torchrun.sh forwards the copy it got (needed when only the wrapper is signalled, as by
``kill PID``). No wrapper can tell which of these the agent already has, so the agent treats
its first stop signal as the request and ignores later ones. It still SIGKILLs workers that
outlive the shutdown timeout, and SIGKILL still ends the agent itself.
"""
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType

from torch.distributed.elastic.multiprocessing import api as elastic_processes
from torch.distributed.run import main

Handler = Callable[[int, FrameType | None], None]


def first_signal_only(handler: Handler) -> Handler:
    """A signal handler that runs ``handler`` for the first signal it gets and ignores the rest
    (any signal number), writing one line to stderr for each one ignored."""
    first: list[signal.Signals] = []

    def handle(signum: int, frame: FrameType | None) -> None:
        if first:
            # os.write, not print or logging: the handler runs between two bytecodes of the
            # main thread, possibly inside the agent's own write to stderr, where a buffered
            # write raises "reentrant call" and that exception would escape as the second
            # SignalException did.
            os.write(2, f"[k3train] torchrun agent: {signal.Signals(signum).name} ignored, already "
                        f"stopping on {first[0].name}\n".encode())
            return
        first.append(signal.Signals(signum))
        handler(signum, frame)

    return handle


def install() -> None:
    """Wrap torchrun's agent handler; ``PContext.start`` looks the name up when it registers it
    (at every start of the workers), so the wrapped one is what gets registered."""
    handler = getattr(elastic_processes, "_terminate_process_handler", None)
    if not callable(handler):
        sys.exit(f"{__file__}: torch {elastic_processes.__name__} has no _terminate_process_handler "
                 "to wrap (a torch this script does not know); a repeated stop signal could make "
                 "torchrun shut down twice and hang")
    elastic_processes._terminate_process_handler = first_signal_only(handler)


if __name__ == "__main__":
    install()
    sys.exit(main())
