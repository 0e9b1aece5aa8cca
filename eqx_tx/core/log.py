"""The package logger, a log-once helper for loud fallbacks, and a recorder of the
compilations a piece of code triggers.

The library only logs to `logging.getLogger("eqx_tx")`; it never configures the
root logger. Applications decide what is shown: the tools call
`enable_console_logging()`, which gives the package logger a handler of its own.
"""

import contextlib
import logging
import sys
from collections.abc import Iterator

import jax

logger = logging.getLogger("eqx_tx")
_seen: set[str] = set()


def log_once(message: str, level: int = logging.INFO) -> None:
    """Log `message` the first time it is seen in this process.

    Used wherever a choice between code paths is made at trace time (attention
    implementation, a dimension left unsharded), so the path that ran is visible
    without flooding the log on every retrace.
    """
    if message not in _seen:
        _seen.add(message)
        logger.log(level, message)


def enable_console_logging(level: int = logging.INFO) -> None:
    """Show the package's messages at `level` and above on stderr, as `[eqx_tx] ...`
    (for scripts; idempotent, and the root logger is left alone)."""
    if not any(getattr(h, "_eqx_tx", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[eqx_tx] %(message)s"))
        handler._eqx_tx = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compile_times() -> Iterator[list[float]]:
    """Record the XLA compilations that run inside the `with` block.

    **Returns:** (as the context value) a list that gets each compilation's seconds,
    in order, while the block runs (from `jax.monitoring`'s compile-duration event).
    """
    seconds: list[float] = []

    def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == _COMPILE_EVENT:
            seconds.append(duration_secs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seconds
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
