"""How the tools in `tools/` start and fail: one entry point for their `__main__`."""

import os
import sys
from collections.abc import Callable
from typing import TypeVar

import tyro

from .host_memory import reexec_with_retaining_malloc

A = TypeVar("A")

# What bad input raises (unknown model, missing file, bad flag values, a failed
# multi-host start): reported as one line, not a traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, KeyError, RuntimeError)


def run_tool(main: Callable[[A], object], args_type: type[A]) -> None:
    """Parse `args_type` from the command line with tyro and run `main` on it.

    XLA:CPU buffers are kept mapped between steps first (`eqx_tx.host_memory`).
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
