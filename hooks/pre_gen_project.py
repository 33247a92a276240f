"""Reject impossible answers before anything is generated (one line on stderr, exit 1)."""

import re
import sys

# Values are rendered as JSON string literals, so quotes and backslashes stay intact.
ANSWERS = {
    "project_name": {{ cookiecutter.project_name | tojson }},
    "author": {{ cookiecutter.author | tojson }},
    "project_slug": {{ cookiecutter.project_slug | tojson }},
    "license": {{ cookiecutter.license | tojson }},
    "python_min": {{ cookiecutter.python_min | tojson }},
    "parallelism": {{ cookiecutter.parallelism | tojson }},
}
# The choices of cookiecutter.json (tests/test_bake.py checks that they agree): --replay and
# extra_context can bypass them.
CHOICES = {
    "license": ["Apache-2.0", "MIT", "BSD-3-Clause"],
    "python_min": ["3.11", "3.12", "3.13"],
    "parallelism": ["spmd", "pmap", "fsdp"],
}

SLUG_RE = re.compile(r"[a-z][a-z0-9_]*[a-z0-9]")
# The longest slug whose import lines fit ruff's 100 columns everywhere in the project (a slug
# derived from the project's name is cut to it, at a word).
SLUG_MAX = 40
# Modules the generated project imports or holds at its top level (the machinery is the package
# named by the slug): a slug with one of these names would shadow one of them.
TAKEN = {
    "jax", "flax", "optax", "grain", "clu", "orbax", "ml_collections", "numpy", "absl",
    "sklearn", "tensorboardX", "tensorboard", "array_record",
    "model", "train", "evaluate", "predict", "export", "aot", "benchmark", "launch",
    "write_arrayrecord", "configs", "portpicker", "tests", "conftest", "shipped_model",
}
TAKEN_LOWER = {name.lower(): name for name in TAKEN}  # case-insensitive file systems


def suggest(slug: str) -> str:
  fixed = re.sub(r"[^a-z0-9]+", "_", slug.lower()).strip("_").lstrip("0123456789_")
  ok = SLUG_RE.fullmatch(fixed) and fixed not in TAKEN_LOWER
  return fixed if ok else f"{fixed or 'my'}_project"


def error() -> str | None:
  for key in ("project_name", "author"):
    if not ANSWERS[key].strip():
      return f"{key} must not be empty"
  slug = ANSWERS["project_slug"]
  if not SLUG_RE.fullmatch(slug):
    return (f"project_slug {slug!r} is not a valid directory and distribution name: it must "
            "start with a lowercase letter, contain only lowercase letters, digits and '_', "
            f"and end with a letter or digit (e.g. {suggest(slug)!r})")
  if len(slug) > SLUG_MAX:
    return (f"project_slug {slug!r} is {len(slug)} characters; give one of at most {SLUG_MAX}, "
            f"so that the project's import lines fit its line length (e.g. "
            f"{suggest(slug[:SLUG_MAX])!r})")
  if slug in TAKEN_LOWER:
    return (f"project_slug {slug!r} would shadow {TAKEN_LOWER[slug]!r}, which the project "
            f"imports or contains (e.g. {suggest(slug)!r})")
  for key in ("license", "python_min", "parallelism"):
    if ANSWERS[key] not in CHOICES[key]:
      return f"{key} {ANSWERS[key]!r} is not one of the choices: {', '.join(CHOICES[key])}"
  return None


if (message := error()) is not None:
  print(f"nnx-dp: {message}", file=sys.stderr)
  sys.exit(1)
