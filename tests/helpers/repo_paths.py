"""Where things are, for tests and the scripts they start: the repository root and this folder of
helpers (the scripts tests run in fresh interpreters live here)."""

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
ROOT = HELPERS.parents[1]
