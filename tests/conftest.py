"""pytest's hooks and shared fixtures for the suite.

The header names the hypothesis profile in use (tests/_examples.py). The student kit
installed per its README into a fresh virtual environment is one fixture for the
session, so that the kit tests (tests/test_kit.py) and the JupyterLab test
(tests/test_jupyterlab.py), run together as ``make kit-tests`` does, install it once.
"""

import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from _examples import PROFILE

ROOT = Path(__file__).resolve().parents[1]


def pytest_report_header(config):
    return f"hypothesis examples: {PROFILE} profile (FIXEDSTATE_TEST_PROFILE)"


@pytest.fixture(scope="session")
def student_kit_install(tmp_path_factory):
    """The student kit, built as `make student-kit` builds it, unpacked into an empty folder outside the
    repository and installed there per its README (its own first command, the pinned dependencies from
    PyPI, into a fresh ``.venv``): ``(folder, python of the kit's environment, seconds it took)``."""
    sys.path.insert(0, str(ROOT / "tools"))
    import kit

    t0 = time.perf_counter()
    build = tmp_path_factory.mktemp("build")
    subprocess.run([sys.executable, str(ROOT / "tools" / "kit.py"), "student-kit", str(build)], check=True)
    (zipped,) = build.glob("*.zip")
    home = tmp_path_factory.mktemp("reader")           # an empty folder, outside the repository
    with zipfile.ZipFile(zipped) as zf:
        zf.extractall(home)
    folder = home / kit.kit_name("student")
    readme = (folder / "README.md").read_text()
    setup = re.search(r"```bash\n(.*?)\n", readme).group(1)
    # the README's own first command, with this interpreter as python3.11
    setup = setup.replace("python3.11 ", f"{sys.executable} ", 1)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    subprocess.run(setup + " --quiet --disable-pip-version-check", shell=True, cwd=folder, env=env, check=True)
    return folder, folder / ".venv" / "bin" / "python", time.perf_counter() - t0
