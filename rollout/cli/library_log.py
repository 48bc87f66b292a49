"""What the libraries underneath say while a command runs (Python warnings, transformers' and TRL's log warnings).

The command line promises one line on stderr for a user error or an interruption. A library's deprecation notice
printed on the way would break that promise, so while a command runs such messages are held here: once the run has
claimed its output folder they go to `warnings.log` in it, and a command that finishes says in one line of its own
how many there were and where. A command that fails or is interrupted prints its one line only (what was already
written to the log stays there).
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import sys

from rollout.cli.files import append_lines

LOG_NAME = "warnings.log"
_PY_WARNINGS = "py.warnings"  # the logger Python's warnings go to under logging.captureWarnings


class LibraryLog(logging.Handler):
    """Holds library warnings until `attach` names the run's folder, then appends them (and every later one) to its
    `warnings.log`, whole lines in one write each."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        self.messages: list[str] = []  # every message, in order
        self.path: pathlib.Path | None = None
        self.transformers_verbosity: int | None = None  # transformers' own level before it was routed here

    def emit(self, record: logging.LogRecord) -> None:
        text = self.format(record).rstrip("\n")
        self.messages.append(text)
        if self.path is not None:
            append_lines(self.path, text + "\n")

    def attach(self, folder: str | pathlib.Path) -> None:
        """Write to `folder / warnings.log` from now on, starting with what was held."""
        self.path = pathlib.Path(folder) / LOG_NAME
        if self.messages:
            append_lines(self.path, "".join(m + "\n" for m in self.messages))

    def report(self, command: str) -> None:
        """After a command that finished: one line naming the log, or (no folder was claimed) each distinct message
        once."""
        if not self.messages:
            return
        if self.path is not None:
            print(f"rollout {command}: {len(self.messages)} library warnings in {self.path}", file=sys.stderr)
            return
        for message in dict.fromkeys(self.messages):
            print(message, file=sys.stderr)


@contextlib.contextmanager
def capture_library_warnings():
    """Route Python warnings and transformers' log warnings into a `LibraryLog` for the block; yields it. Each
    warning keeps Python's rule of once per place in the code."""
    log = LibraryLog()
    py_logger = logging.getLogger(_PY_WARNINGS)
    # TRL logs through Python's logging (accelerate's adapter): with no handler of its own, Python's last resort
    # printed its warnings on stderr (a null reward's, every step)
    loggers = [py_logger, logging.getLogger("trl")]
    propagate = [logger.propagate for logger in loggers]
    logging.captureWarnings(True)
    for logger in loggers:
        logger.addHandler(log)
        logger.propagate = False  # not on to the root logger's stderr handler
    if "transformers" in sys.modules:  # otherwise routed when a command imports it (`route_transformers`)
        route_transformers(log)
    try:
        yield log
    finally:
        logging.captureWarnings(False)
        for logger, flag in zip(loggers, propagate):
            logger.removeHandler(log)
            logger.propagate = flag
        if log.transformers_verbosity is not None:  # transformers' logging as it was
            import transformers

            tl = transformers.utils.logging
            tl.get_logger().removeHandler(log)  # not tl.remove_handler: 5.0's asserts the opposite of what it should
            tl.enable_default_handler()
            tl.set_verbosity(log.transformers_verbosity)


def route_transformers(log: LibraryLog | None = None) -> None:
    """Send transformers' own log warnings to `log` (default: the one capturing now, if any) instead of stderr."""
    log = log if log is not None else current_log()
    if log is None or log.transformers_verbosity is not None:
        return
    import transformers

    tl = transformers.utils.logging
    log.transformers_verbosity = tl.get_verbosity()
    tl.disable_default_handler()
    tl.set_verbosity_warning()
    tl.get_logger().addHandler(log)


def current_log() -> LibraryLog | None:
    """The `LibraryLog` capturing now, if a command set one up."""
    for handler in logging.getLogger(_PY_WARNINGS).handlers:
        if isinstance(handler, LibraryLog):
            return handler
    return None


def attach_library_log(folder: str | pathlib.Path) -> None:
    """Called once a run has claimed its output folder: library warnings go to its `warnings.log` from now on."""
    log = current_log()
    if log is not None:
        log.attach(folder)
