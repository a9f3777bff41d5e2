"""Runtime machinery between kernels/ and nodes/: planning, patching, tiling."""

import logging

_logged: set[tuple[str, str]] = set()


def log_once(log: logging.Logger, level: int, msg: str) -> None:
    """Log `msg` once per process and logger: for fallbacks and skipped modules."""
    if (log.name, msg) not in _logged:
        _logged.add((log.name, msg))
        log.log(level, msg)
