import tempfile

import pytest


@pytest.fixture(autouse=True, scope="session")
def _hook_scripts_in_pytest_tmp(tmp_path_factory):
  """Cookiecutter renders each hook into a temporary file that it never deletes: keep those
  inside pytest's own temporary directory instead of the system's."""
  previous = tempfile.tempdir
  tempfile.tempdir = str(tmp_path_factory.mktemp("hook_scripts"))
  yield
  tempfile.tempdir = previous
