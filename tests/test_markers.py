"""The suite's own selection, run on a small suite in a fresh pytest process with this
checkout's ``pyproject.toml`` and ``tests/conftest.py``: the plain ``pytest`` leaves out the
``slow`` cases, ``pytest -m slow`` runs only them (a later ``-m`` wins over the one in
addopts), and a ``gpu`` test is skipped exactly where cupy sees no CUDA device."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import gpu_available

HERE = Path(__file__).resolve().parent

SAMPLE = '''
import pytest

def test_fast():
    pass

@pytest.mark.slow
def test_slow():
    pass

@pytest.mark.gpu
def test_gpu():
    import cupy
    assert cupy.cuda.runtime.getDeviceCount() > 0
'''


@pytest.fixture
def sample(tmp_path):
    (tmp_path / "tests").mkdir()
    shutil.copy(HERE.parent / "pyproject.toml", tmp_path)
    shutil.copy(HERE / "conftest.py", tmp_path / "tests")
    (tmp_path / "tests" / "test_sample.py").write_text(SAMPLE)
    return tmp_path


def _outcomes(folder, *args) -> dict[str, str]:
    """Each test's outcome in ``pytest -v *args`` run in ``folder``."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", *args],
                       cwd=folder, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # -v prints "tests/test_sample.py::test_fast PASSED [ 50%]" for each test it ran
    found = re.findall(r"^tests/test_sample\.py::(\w+) (PASSED|SKIPPED|FAILED)", r.stdout, re.M)
    return dict(found)


@pytest.mark.slow  # (which also shows that the slow run reaches it)
def test_plain_pytest_leaves_out_slow_and_minus_m_slow_runs_only_them(sample):
    gpu = "PASSED" if gpu_available() else "SKIPPED"
    assert _outcomes(sample) == {"test_fast": "PASSED", "test_gpu": gpu}
    assert _outcomes(sample, "-m", "slow") == {"test_slow": "PASSED"}
    assert _outcomes(sample, "-m", "slow or not slow") == {
        "test_fast": "PASSED", "test_slow": "PASSED", "test_gpu": gpu}
