"""User-facing errors: the CLI prints these as one line (no traceback) and exits non-zero."""


class SpecjaxError(Exception):
  """Bad input or environment; the message names the problem and the fix."""


class ModelNotFoundError(SpecjaxError):
  pass


class CheckpointError(SpecjaxError):
  pass


class ConfigError(SpecjaxError):
  pass
