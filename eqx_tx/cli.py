"""How the tools in `tools/` start and fail: one entry point for their `__main__`."""

import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import tyro

from .analysis.host_memory import reexec_with_retaining_malloc

A = TypeVar("A")

# What bad input raises (unknown model, missing file, bad flag values, a failed
# multi-host start): reported as one line, not a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, KeyError, RuntimeError)


def run_tool(main: Callable[[A], object], args_type: type[A]) -> None:
    """Parse `args_type` from the command line with tyro and run `main` on it.

    XLA:CPU buffers are kept mapped between steps first (`eqx_tx.analysis.host_memory`).
    An error in `USER_ERRORS` ends the process with `error: <message>` on stderr
    and status 2 (`EQX_TX_DEBUG=1`: the traceback instead).
    """
    reexec_with_retaining_malloc()
    try:
        main(tyro.cli(args_type))
    except USER_ERRORS as e:
        if os.environ.get("EQX_TX_DEBUG"):
            raise
        print(f"error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        sys.exit(2)


def check_output_dir(output_dir: str, *, resume: bool, overwrite: bool) -> None:
    """Raise unless `--resume` / `--overwrite` agree with what `output_dir` holds: a
    run's files are never replaced or mixed with a new run's by accident."""
    if resume and overwrite:
        raise ValueError("--resume continues the run in --output-dir and --overwrite replaces it: give one")
    existing = sorted(os.listdir(output_dir)) if os.path.isdir(output_dir) else []
    if existing and not (resume or overwrite):
        raise ValueError(
            f"--output-dir {output_dir} is not empty ({', '.join(existing[:5])}); pass --resume to continue "
            "the run there or --overwrite to replace it"
        )


def check_resume(checkpoint_dir: str, settings: dict) -> None:
    """Raise if the newest checkpoint in `checkpoint_dir` was saved by a run with other
    `settings` (JSON values, compared with its metadata): `--resume` continues a run, it
    does not start a different one from its weights."""
    from .train.checkpoint import read_metadata

    meta = read_metadata(checkpoint_dir)
    changed = {k: (meta.get(k), v) for k, v in settings.items() if meta.get(k) != v}
    if changed:
        raise ValueError(f"--resume with different settings than the checkpoint (saved, given): {changed}")


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM (a preemption) during a training loop, as a context.

    The first signal is recorded (`received`) and the loop is expected to finish its
    step, save a checkpoint and call `exit`; a second one stops at once
    (`KeyboardInterrupt`). Outside the main thread (where no handler can be set)
    nothing is caught. The previous handlers come back on leaving the context.
    """

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
              "(send it again to stop at once, losing the step)", file=sys.stderr, flush=True)

    def exit(self, step: int, checkpoint_dir: str) -> None:
        """Say where the run stopped and how to go on; exit with 128 + the signal number."""
        assert self.received is not None
        name = signal.Signals(self.received).name
        command = " ".join(a for a in sys.argv if a not in ("--resume", "--overwrite"))
        print(f"{name}: stopped after step {step}; checkpoint in {checkpoint_dir}\n"
              f"continue with: python {command} --resume", file=sys.stderr, flush=True)
        raise SystemExit(128 + self.received)
