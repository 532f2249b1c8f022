"""Progress output: a bar on a terminal, plain lines in a log file."""
import io

from specjax import progress


def test_lines_when_redirected_to_a_file():
  out = io.StringIO()
  bar = progress.progress(stream=out)
  assert isinstance(bar, progress.LineProgress)
  bar.every_s = 0.0
  with bar:
    task = bar.add_task("train", total=4, completed=1, info="")
    bar.update(task, completed=2, info="loss 3.5")
    bar.update(task, advance=2, info="loss 2.25")
  lines = out.getvalue().splitlines()
  assert lines[0].startswith("[train] 2/4 (50%) loss 3.5 elapsed 0:00:00")
  assert " eta " in lines[0]
  assert lines[1].startswith("[train] 4/4 (100%) loss 2.25") and " eta " not in lines[1]


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
