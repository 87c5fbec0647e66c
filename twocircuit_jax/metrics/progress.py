"""Progress a terminal and a log file can both read.

In a terminal a tqdm bar redraws itself in place with carriage returns. Written to a file (`make demo > log`, CI,
a SLURM log) those frames pile up into one enormous line that no one can read or grep. `progress()` therefore
returns a tqdm bar only when the stream is a terminal (or a notebook, where tqdm draws a widget), and otherwise a
`PlainProgress`: the same small interface (`n`, `total`, `update`, `set_description`, `set_postfix`, `close`),
printing one newline-terminated line at most every `every_s` seconds, one at the first update (the first step,
which includes the compiles, is done) and one at the end.
"""

from __future__ import annotations

import sys
import time

EVERY_S = 10.0  # seconds between two plain lines: often enough to see a run move, rare enough to keep a log short


def _is_tty(stream) -> bool:
    """Whether `stream` is a terminal; a stream without isatty (or a closed one) counts as a file."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _in_notebook() -> bool:
    """A Jupyter kernel: its output streams are no TTY, yet tqdm.auto draws a widget there, not carriage returns."""
    shell = sys.modules.get("IPython")
    ip = shell.get_ipython() if shell is not None and hasattr(shell, "get_ipython") else None
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def _clock_text(seconds: float) -> str:
    """H:MM:SS or M:SS, as tqdm writes elapsed time."""
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class PlainProgress:
    """A progress reporter for logs: one plain line per report, never a carriage return. Nothing is printed when
    `disable` is set (the trainer's show_progress=False), as with tqdm."""

    def __init__(
        self,
        total=None,
        initial: int = 0,
        desc: str = "",
        unit: str = "it",
        disable: bool = False,
        stream=None,
        every_s: float = EVERY_S,
        clock=time.monotonic,
    ):
        self.total, self.n, self.desc, self.unit, self.disable = total, initial, desc, unit, disable
        self._stream = sys.stderr if stream is None else stream
        self._every_s, self._clock = every_s, clock
        self._initial, self._start = initial, clock()
        self._last_line_at = None  # clock time of the last line written, None before the first
        self._last_line_n = None  # the count that line showed
        self._postfix: dict[str, str] = {}

    def set_description(self, desc: str, refresh: bool = True):
        self.desc = desc

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs):
        self._postfix = {str(k): str(v) for k, v in {**(ordered_dict or {}), **kwargs}.items()}

    def update(self, n: int = 1):
        """Advance by n; write a line if none was written yet or the last one is `every_s` old."""
        self.n += n
        now = self._clock()
        if self._last_line_at is None or now - self._last_line_at >= self._every_s:
            self._write(now)

    def close(self):
        """The final line, unless the last line written already showed the final count."""
        if self._last_line_n != self.n:
            self._write(self._clock())
        self.disable = True  # closed: later calls print nothing, as a closed tqdm bar

    def line(self, now: float) -> str:
        """`grpo: 12/100 step (12%), 0.53 step/s, 0:23 elapsed, reward=0.312, eval=-`."""
        elapsed = max(now - self._start, 0.0)
        done = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        rate = f"{(self.n - self._initial) / elapsed:.3g} {self.unit}/s" if elapsed > 0 else f"? {self.unit}/s"
        parts = [f"{done} {self.unit}{pct}", rate, f"{_clock_text(elapsed)} elapsed"]
        parts += [f"{k}={v}" for k, v in self._postfix.items()]
        return (f"{self.desc}: " if self.desc else "") + ", ".join(parts)

    def _write(self, now: float):
        if self.disable:
            return
        self._stream.write(self.line(now) + "\n")
        self._stream.flush()  # a log tailed during the run sees the line now, not when a buffer fills
        self._last_line_at, self._last_line_n = now, self.n


def progress(
    total=None,
    initial: int = 0,
    desc: str = "",
    unit: str = "it",
    disable: bool = False,
    stream=None,
    every_s: float = EVERY_S,
    clock=time.monotonic,
    **tqdm_kw,
):
    """A tqdm bar on a terminal or in a notebook (`tqdm_kw` goes to it), a `PlainProgress` everywhere else (files,
    pipes, CI, SLURM; `every_s` and `clock` go to it). `stream` defaults to stderr, where tqdm writes."""
    stream = sys.stderr if stream is None else stream
    if not disable and (_is_tty(stream) or _in_notebook()):
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc=desc or None, unit=unit, file=stream, **tqdm_kw)
    return PlainProgress(total, initial, desc, unit, disable, stream, every_s, clock)
