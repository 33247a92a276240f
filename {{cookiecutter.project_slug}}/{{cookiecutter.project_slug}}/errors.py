"""The one error of a run that cannot work, at the bottom of the imports: the config checker
(plan.py), the data sources and the workdir's reader (runs.py) raise it."""


class ConfigError(ValueError):
  """A config, flag or path that cannot work; the message names the key, the value and the fix."""
