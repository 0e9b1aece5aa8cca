"""The package logger and a log-once helper for loud fallbacks.

The library only logs to `logging.getLogger("eqx_tx")`; it never configures the
root logger. Applications decide what is shown: the tools call
`enable_console_logging()`, which gives the package logger a handler of its own.
"""

import logging
import sys

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
