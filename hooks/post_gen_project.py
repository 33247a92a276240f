"""Drop the optional parts the answers did not ask for."""

import shutil
from pathlib import Path

GITHUB_ACTIONS = "{{ cookiecutter.github_actions }}".strip().lower() in {"true", "yes", "y", "1"}

if not GITHUB_ACTIONS:
  shutil.rmtree(Path.cwd() / ".github")
