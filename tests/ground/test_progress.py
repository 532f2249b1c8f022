"""Progress output: a bar on a terminal, plain lines in a log file."""
import io

from specjax import progress


def test_lines_when_redirected_to_a_file():
  out = io.StringIO()
  assert isinstance(progress.progress(stream=out), progress.LineProgress)
  now = [100.0]
  bar = progress.LineProgress(out, every_s=30.0, clock=lambda: now[0])
  with bar:
    task = bar.add_task("train", total=4, completed=1, info="")
    now[0] += 20.0
    bar.update(task, completed=2, info="loss 3.5")       # 20 s since the start: not yet
    now[0] += 40.0
    bar.update(task, completed=3, info="loss 3.0")       # 2 steps in 60 s: 30 s a step, 1 step left
    now[0] += 5.0
    bar.update(task, advance=1, info="loss 2.25")        # the last is always written
  assert out.getvalue().splitlines() == ["[train] 3/4 (75%) loss 3.0 elapsed 0:01:00 eta 0:00:30",
                                         "[train] 4/4 (100%) loss 2.25 elapsed 0:01:05"]


def test_lines_are_rate_limited_but_the_last_is_always_written():
  out = io.StringIO()
  with progress.LineProgress(out, every_s=3600.0) as bar:
    task = bar.add_task("target replies", total=10)
    for _ in range(10):
      bar.update(task, advance=1)
  assert out.getvalue().splitlines() == [out.getvalue().splitlines()[-1]]
  assert out.getvalue().startswith("[target replies] 10/10 (100%)")


def test_disabled_writes_nothing():
  out = io.StringIO()
  with progress.progress(enabled=False, stream=out) as bar:
    bar.update(bar.add_task("train", total=2), completed=2)
  assert out.getvalue() == ""


def test_a_terminal_gets_the_rich_bar():
  class Tty(io.StringIO):
    def isatty(self):
      return True
  from rich.progress import Progress
  assert isinstance(progress.progress(stream=Tty()), Progress)
