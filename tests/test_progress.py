"""Progress reporting (twocircuit_jax/metrics/progress.py): plain, rate-limited lines for a log file, tqdm's bar for
a terminal. The clock is injected: no test sleeps."""

import io

from tqdm import tqdm

from twocircuit_jax.metrics.progress import PlainProgress, progress


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class FakeTerminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self):
        return True


def _steps(bar, clock, times):
    """One update per entry of `times` (seconds since the start)."""
    start = clock.t
    for t in times:
        clock.t = start + t
        bar.update(1)


def test_a_file_gets_plain_newline_terminated_lines():
    out, clock = io.StringIO(), Clock()
    bar = progress(total=5, desc="grpo", unit="step", stream=out, clock=clock)
    assert isinstance(bar, PlainProgress)
    bar.set_postfix(reward="0.250", eval="-", refresh=False)
    _steps(bar, clock, [4.0, 5.0, 6.0, 7.0, 8.0])
    bar.close()
    text = out.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert lines[0] == "grpo: 1/5 step (20%), 0.25 step/s, 0:04 elapsed, reward=0.250, eval=-"
    assert lines[-1] == "grpo: 5/5 step (100%), 0.625 step/s, 0:08 elapsed, reward=0.250, eval=-"


def test_lines_are_rate_limited():
    out, clock = io.StringIO(), Clock()
    bar = progress(total=100, desc="grpo", unit="step", stream=out, clock=clock, every_s=10.0)
    _steps(bar, clock, [0.5 * k for k in range(1, 61)])  # 60 steps in 30 s
    lines = out.getvalue().splitlines()
    # the first step, then one line each time 10 s have passed since the last line (10.5 s, 20.5 s)
    assert [line.split(" step")[0] for line in lines] == ["grpo: 1/100", "grpo: 21/100", "grpo: 41/100"]
    bar.close()  # the end always gets its line
    assert out.getvalue().splitlines()[-1].startswith("grpo: 60/100 step (60%)")
    bar.close()  # and only one
    assert len(out.getvalue().splitlines()) == 4


def test_close_right_after_a_line_adds_no_duplicate():
    out, clock = io.StringIO(), Clock()
    bar = progress(total=1, stream=out, clock=clock)
    _steps(bar, clock, [3.0])
    bar.close()
    assert out.getvalue().count("\n") == 1


def test_resumed_rate_counts_only_this_process_steps():
    out, clock = io.StringIO(), Clock()
    bar = progress(total=10, initial=6, unit="step", stream=out, clock=clock)
    _steps(bar, clock, [2.0, 4.0])
    bar.close()
    assert out.getvalue().splitlines()[-1].startswith("8/10 step (80%), 0.5 step/s")


def test_disabled_prints_nothing():
    out, clock = io.StringIO(), Clock()
    for stream in (out, FakeTerminal()):
        bar = progress(total=3, disable=True, stream=stream, clock=clock)
        _steps(bar, clock, [20.0, 40.0])
        bar.close()
        assert stream.getvalue() == ""


def test_a_terminal_keeps_tqdm():
    term = FakeTerminal()
    bar = progress(total=3, desc="grpo", unit="step", stream=term)
    assert isinstance(bar, tqdm)
    bar.update(3)
    bar.close()
    assert "\r" in term.getvalue() and "grpo" in term.getvalue()


def test_metrics_logger_writes_plain_lines_to_a_file(tmp_path, monkeypatch):
    """The trainer's progress (MetricsLogger) on a stderr that is a file: lines with the postfix, no '\\r'."""
    import sys

    from twocircuit_jax.metrics.logger import MetricsLogger

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with MetricsLogger(tmp_path, total_steps=2) as lg:
        lg.log(1, {"reward/mean": 0.5})
        lg.log(2, {"reward/mean": 0.75, "eval/accuracy": 0.25})
    lines = err.getvalue().splitlines()
    assert "\r" not in err.getvalue()
    assert lines[0].startswith("grpo: 1/2 step (50%)") and lines[0].endswith("reward=0.500, eval=-")
    assert lines[-1].startswith("grpo: 2/2 step (100%)") and lines[-1].endswith("reward=0.750, eval=0.250")
