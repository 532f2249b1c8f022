"""The README's test command is the one .ci/run runs."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
  readme = (ROOT / "README.md").read_text()
  commands = re.findall(r"```bash\n(.+?)\n```", readme)
  test_cmd = next(c for c in commands if "pytest" in c)
  ci = (ROOT / ".ci" / "run").read_text().splitlines()
  assert test_cmd.strip() in [line.strip() for line in ci]
  assert any("specjax run configs/quickstart.gin" in c for c in commands)
