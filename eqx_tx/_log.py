"""The package logger and a log-once helper for loud fallbacks."""

import logging

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
        if not logger.handlers and not logging.getLogger().handlers:
            logging.basicConfig(format="[eqx_tx] %(message)s")
            logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
        logger.log(level, message)
