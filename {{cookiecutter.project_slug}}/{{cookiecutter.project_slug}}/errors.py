"""The errors of a run that cannot work, at the bottom of the imports: the config checker
(plan.py), the data sources and the workdir's reader (runs.py) raise them."""


class ConfigError(ValueError):
  """A config, flag or path that cannot work; the message names the key, the value and the fix."""


class BadData(ValueError):
  """Too many records of a dataset could not be read; the message names the first and the fix."""
