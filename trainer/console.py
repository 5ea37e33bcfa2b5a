"""What a command tells its user while it works: lines, and progress on every long phase.

A command sets the console up once (:func:`setup`): only process 0 speaks, and
the command says where (``python -m trainer`` on stdout, a command whose stdout is
its result on stderr). Library code reports through :func:`say`, :func:`warn`,
:func:`phase` and :func:`progress` and never decides where output goes; used from
Python without a command, the console writes to stderr, so that a program's own
stdout stays its own.

* :func:`warn`, something that did not stop the work: one ``warning:`` line on
  stderr (every warning of the project goes through here).

* :func:`phase`, a step of unknown length (a compile, a checkpoint read, a
  dataset generated): a line when it starts and one when it ends; in between,
  on a terminal a running clock, elsewhere a line every :data:`PLAIN_EVERY_S`.
* :class:`StepLine`, a training run's steps: on a terminal a live line between
  its log lines; nothing elsewhere.
* :func:`progress`, counted work (evaluation batches, sentences): on a terminal a
  tqdm bar that goes when the work is done; elsewhere (a log file, CI, a pipe)
  a plain line at most every :data:`PLAIN_EVERY_S` seconds. Either way, work
  that took longer than that ends with one line saying how much and how long,
  and quick work leaves no trace (an evaluation every few hundred steps would
  otherwise add lines between the step lines).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Any

import tqdm

# Plain (non-terminal) progress: a line at most this often.
PLAIN_EVERY_S = 10.0
# A terminal's running clock for a phase of unknown length is redrawn this often.
_TICK_S = 0.5


@dataclasses.dataclass
class _Settings:
    enabled: bool = True
    stream: IO[str] | None = None  # None: sys.stderr at the time of writing
    interactive: bool | None = None  # None: whether the stream is a terminal
    last_line: float = 0.0  # time.monotonic() of the last line said
    doing: str = "starting"  # what the process is doing, for lines that say so


_settings = _Settings()


def setup(
    *, enabled: bool = True, stream: IO[str] | None = None, interactive: bool | None = None
) -> None:
    """Sets where the console goes, for the whole process (a command calls it once).

    Args:
      enabled: False on every process but the first: they say nothing.
      stream: where lines and bars go (default stderr: ``python -m trainer`` asks
        for stdout; ``trainer.translate`` writes its translations there).
      interactive: bars (True) or plain lines (False); default: bars only if
        ``stream`` is a terminal.
    """
    _settings.enabled = enabled
    _settings.stream = stream
    _settings.interactive = interactive


def _stream() -> IO[str]:
    return _settings.stream or sys.stderr


def is_interactive() -> bool:
    """Whether progress is drawn as bars (a terminal) rather than plain lines."""
    if _settings.interactive is not None:
        return _settings.interactive
    isatty = getattr(_stream(), "isatty", None)
    return bool(isatty and isatty())


def activity() -> str:
    """What the process is doing, as its console last said (a phase, or the step a
    training run has reached): for a line written from another thread."""
    return _settings.doing


def say(message: str) -> None:
    """One line, on process 0 (above any bar or clock being drawn)."""
    if not _settings.enabled:
        return
    _settings.last_line = time.monotonic()
    if is_interactive():
        tqdm.tqdm.write(message, file=_stream())
        _stream().flush()
    else:
        print(message, file=_stream(), flush=True)


def warn(message: str) -> None:
    """Tells the user about something that did not stop the work: one ``warning:``
    line on stderr (above any bar being drawn), from process 0 only."""
    if not _settings.enabled:
        return
    line = f"warning: {' '.join(str(message).split())}"
    if is_interactive() and _stream() is sys.stderr:
        tqdm.tqdm.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)


def duration(seconds: float) -> str:
    """``3.2`` -> ``'3.2s'``; ``75`` -> ``'1m15s'``; ``3725`` -> ``'1h02m'``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class Progress:
    """Progress through ``total`` units (None: unknown): a bar on a terminal, plain
    lines elsewhere, nothing on other processes. Iterate over it (when made with
    an iterable) or call :meth:`update`; :meth:`close` (or leaving the ``with``
    block) prints the closing line."""

    def __init__(self, iterable: Iterable | None, *, total: int | None, desc: str, unit: str):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self._iterable = iterable
        self._desc, self._unit, self.total = desc, unit, total
        self.n = 0
        self._start = self._last_line = time.perf_counter()
        self._bar = None
        self._closed = False
        if not _settings.enabled:
            return
        if is_interactive():
            self._bar = tqdm.tqdm(
                # " batches": tqdm writes the count and the unit together ("3 batches").
                total=total,
                desc=desc,
                unit=f" {unit}",
                file=_stream(),
                dynamic_ncols=True,
                leave=False,
            )

    def __iter__(self) -> Iterator[Any]:
        with self:
            for item in self._iterable:
                yield item
                self.update(1)

    def update(self, n: int = 1) -> None:
        """Adds ``n`` units done."""
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif _settings.enabled and time.perf_counter() - self._last_line >= PLAIN_EVERY_S:
            self._last_line = time.perf_counter()
            of = f"/{self.total}" if self.total else ""
            say(f"{self._desc}: {self.n}{of} {self._unit} ({duration(self.elapsed)})")

    @property
    def elapsed(self) -> float:
        """Seconds since the progress started."""
        return time.perf_counter() - self._start

    def close(self) -> None:
        """Ends the bar; says how much and how long if it took a while."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if _settings.enabled and self.elapsed >= PLAIN_EVERY_S:
            say(f"{self._desc}: {self.n} {self._unit} in {duration(self.elapsed)}")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(
    iterable: Iterable | None = None, *, total: int | None = None, desc: str, unit: str = "it"
) -> Progress:
    """A :class:`Progress` over ``iterable`` (or of ``total`` units, updated by hand)."""
    return Progress(iterable, total=total, desc=desc, unit=unit)


class StepLine:
    """A training run's live line between its log lines. On a terminal: the step, the
    rate and the time left, redrawn in place every second. Elsewhere (a log file, a
    pipe): a plain ``step N/T (X steps/s)`` line whenever nothing else was said for
    :data:`PLAIN_EVERY_S`, so that a pipe is never silent longer while the run
    trains. :meth:`update` at each loop boundary."""

    def __init__(self, *, step: int, total: int):
        self._bar, self._ticker = None, None
        self._step, self._total = step, total
        self._rate_from = (step, time.monotonic())  # for the plain line's rate
        if not _settings.enabled:
            return
        if not is_interactive():
            self._ticker = _Ticker(1.0, self._plain_line)
            return
        self._bar = tqdm.tqdm(
            total=total,
            initial=step,
            unit=" steps",
            bar_format="step {n}/{total} | {rate_fmt} | ETA {remaining}",
            file=_stream(),
            dynamic_ncols=True,
            leave=False,
            smoothing=0.3,  # a loop after an evaluation weighs less than the recent ones
        )
        self._ticker = _Ticker(1.0, self._bar.refresh)

    def _plain_line(self) -> None:
        if time.monotonic() - _settings.last_line < PLAIN_EVERY_S:
            return
        first, since = self._rate_from
        seconds = time.monotonic() - since
        rate = f" ({(self._step - first) / seconds:.2f} steps/s)" if self._step > first else ""
        say(f"step {self._step}/{self._total}{rate}")

    def update(self, step: int) -> None:
        """The run has reached ``step``."""
        self._step = step
        _settings.doing = f"training, past step {step} of {self._total}"
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.refresh()  # at once: loop boundaries are seconds apart

    def close(self) -> None:
        """Removes the line (stops the plain one)."""
        if self._ticker is not None:
            self._ticker.stop()
            self._ticker = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@dataclasses.dataclass
class Phase:
    """A phase of unknown length as it runs; :attr:`seconds` is set when it ends."""

    what: str
    seconds: float = 0.0


@contextlib.contextmanager
def phase(what: str, *, done: str = "done") -> Iterator[Phase]:
    """Says ``what ...`` before a long step of unknown length (a compile, a
    checkpoint read), shows the elapsed time while it runs on a terminal, and
    ``what: done in 12.3s`` when it ends. Yields a :class:`Phase` whose
    ``seconds`` the caller can read after the block."""
    record = Phase(what)
    start = time.perf_counter()
    before, _settings.doing = _settings.doing, what
    ticker = None
    if _settings.enabled and is_interactive():
        ticker = _Clock(what)
    else:
        say(f"{what} ...")
        if _settings.enabled:
            ticker = _heartbeat(what)
    try:
        yield record
    finally:
        _settings.doing = before
        record.seconds = time.perf_counter() - start
        if ticker is not None:
            ticker.stop()
        if _settings.enabled and sys.exc_info()[0] is None:
            say(f"{what}: {done} in {duration(record.seconds)}")


class _Ticker:
    """Calls ``action`` every ``seconds`` in a thread, until :meth:`stop` (the redraws
    of bars and clocks, the plain heartbeat of a phase)."""

    def __init__(self, seconds: float, action: Callable[[], None]):
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(seconds, action), daemon=True)
        self._thread.start()

    def _run(self, seconds: float, action: Callable[[], None]) -> None:
        while not self._stopped.wait(seconds):
            action()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


def _heartbeat(what: str) -> _Ticker:
    """Plain output's sign of life in a long phase: ``what ... 20s`` every
    :data:`PLAIN_EVERY_S` seconds."""
    start = time.perf_counter()
    return _Ticker(
        PLAIN_EVERY_S, lambda: say(f"{what} ... {duration(time.perf_counter() - start)}")
    )


class _Clock:
    """A terminal line ``what ... 12s`` redrawn in place until :meth:`stop`."""

    def __init__(self, what: str):
        self._bar = tqdm.tqdm(
            total=None, desc=f"{what} ...", bar_format="{desc} {elapsed}", file=_stream()
        )
        self._ticker = _Ticker(_TICK_S, self._bar.refresh)

    def stop(self) -> None:
        self._ticker.stop()
        self._bar.leave = False  # the closing line replaces the clock
        self._bar.close()
