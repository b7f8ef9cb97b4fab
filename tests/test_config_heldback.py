"""distmm's settings as a user meets them: a bad value from each source names where it came
from, a name with blanks around it, a duration that is no finite number, numpy scalars, and
a dask YAML file that cannot be read.

Covers: ``DISTMM_<KEY>`` and ``DASK_DISTMM__<KEY>`` variables in fresh processes (the API's
``ValueError`` and the command line's one line, status 2), ``dask.config.set`` over an
environment variable (not named as the source), the named-choice and duration keys, numpy
values through ``get_config``'s cache, and a dangling ``distmm.yaml`` link in ``DASK_CONFIG``
(one warning line).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dask.config

import distmm
from conftest import run_cli
from distmm.config import get_config

_CLEAN = {k: None for k in os.environ if k.startswith(("DASK_DISTMM", "DISTMM_"))}

_API_PROBE = textwrap.dedent("""
    import sys
    import numpy as np
    import dask.config
    import distmm
    a = np.ones((3, 5))
    try:
        if sys.argv[1:]:
            with dask.config.set({"distmm." + sys.argv[1]: sys.argv[2]}):
                distmm.matmul(a, a.T)
        else:
            distmm.matmul(a, a.T)
    except ValueError as e:
        print(str(e))
    else:
        print("no error")
""")


def _api(env: dict, *args) -> str:
    full = {k: v for k, v in {**os.environ, **_CLEAN, "DASK_CONFIG": None, **env}.items()
            if v is not None}
    res = subprocess.run([sys.executable, "-c", _API_PROBE, *args], env=full,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip()


@pytest.mark.parametrize("variable, value, shown", [
    ("DISTMM_TILE", "[64, 64]", "distmm.tile = [64, 64] is not valid: "),
    ("DASK_DISTMM__LOCAL_THREADS", "0", "distmm.local-threads = 0 is not valid: "),
    ("DISTMM_MEMORY_BUDGET", "nan", "distmm.memory-budget = 'nan' is not valid: "),
    ("DISTMM_DIRECT_WRITES", "maybe", "distmm.direct-writes = 'maybe' is not valid: "),
])
def test_a_bad_environment_value_names_its_variable(variable, value, shown):
    """The message named the key, the value and both variables a key may be set by, never
    the one that set it (a YAML file's was named: 'from the dask YAML file ...')."""
    message = _api({variable: value})
    assert shown in message and f"(from the environment variable {variable}; " in message, \
        message


def test_a_bad_value_set_over_a_variable_is_not_said_to_come_from_it():
    message = _api({"DISTMM_PRECISION": "tf32"}, "precision", "fp8")
    assert "distmm.precision = 'fp8' is not valid: " in message, message
    assert "from the environment variable" not in message, message


@pytest.mark.slow  # two commands, ~4 s
def test_a_bad_environment_value_at_the_command_line_names_its_variable(tmp_path):
    for command in (("plan", 64, 64, 64), ("info",)):
        res = run_cli(*command, cwd=tmp_path, timeout=120,
                      env={**_CLEAN, "DASK_CONFIG": None, "DASK_DISTMM__BATCH_STRIPES": "-3"})
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert "Traceback" not in res.stderr and not res.stdout, res.stdout
        assert ("distmm.batch-stripes = -3 is not valid: a positive integer is needed (from the "
                "environment variable DASK_DISTMM__BATCH_STRIPES; ") in res.stderr, res.stderr


@pytest.mark.parametrize("key, value, field", [
    ("engine", "local ", "local"),
    ("backend", " numba", "numba"),
    ("dask-layout", "tiles\n", "tiles"),
    ("batch-panels", " read ", "read"),
    ("mpi-cpus", "keep ", "keep"),
    ("precision", "tf32 ", "tf32"),
])
def test_blanks_around_a_name_are_no_part_of_it(key, value, field):
    """``DISTMM_ENGINE='local '`` (a job script's trailing blank) was refused ("one of auto,
    local, dask, mpi is needed"), where every other key (sizes, numbers, durations, booleans,
    precision, dask-device-transfer) takes blanks around its value."""
    with dask.config.set({f"distmm.{key}": value}):
        assert getattr(get_config(), key.replace("-", "_")) == field
        a = np.random.default_rng().standard_normal((7, 5))
        np.testing.assert_allclose(distmm.matmul(a, a.T), a @ a.T, rtol=1e-12, atol=1e-12)
    with dask.config.set({f"distmm.{key}": value.strip() + "x"}):
        with pytest.raises(ValueError, match=f"distmm\\.{key} = "):
            get_config()


def test_blanks_around_a_name_from_the_environment():
    assert _api({"DISTMM_ENGINE": "local "}) == "no error"


@pytest.mark.parametrize("key", ["retry-timeout", "mpi-join-warning", "mpi-join-timeout",
                                 "device-keep"])
@pytest.mark.parametrize("value", ["inf", "nan", "NaN", "Infinity"])
def test_a_duration_that_is_no_finite_number(key, value):
    """'inf' and 'nan' were "not a duration ('Invalid time unit: inf. Valid units are: s, ms,
    ... NANOSECONDS')", dask's message with its 60 spellings of the units, where '1e400' (and
    any other spelling of infinity) was 'must be a ... finite duration'."""
    with dask.config.set({f"distmm.{key}": value}):
        with pytest.raises(ValueError) as info:
            distmm.matmul(np.ones((2, 2)), np.ones((2, 2)))
    message = str(info.value)
    assert f"distmm.{key} = {value!r} is not valid: must be a " in message, message
    assert "finite duration" in message and "NANOSECONDS" not in message, message


def test_a_duration_in_no_unit_names_the_units_briefly():
    with dask.config.set({"distmm.retry-timeout": "1 fortnight"}):
        with pytest.raises(ValueError) as info:
            get_config()
    message = str(info.value)
    assert ("distmm.retry-timeout = '1 fortnight' is not valid: not a duration (seconds, or a "
            "number and a unit: ms, s, m, h, d, w)") in message, message
    assert len(message) < 300, message


def _config_folder(tmp_path):
    """A dask config folder: a setting in one file, and distmm.yaml a link to a file that is
    not there (a dotfile link left behind), which dask skips as unreadable."""
    folder = tmp_path / "dask-config"
    folder.mkdir()
    (folder / "other.yaml").write_text("distmm:\n  batch-stripes: 5\n")
    (folder / "distmm.yaml").symlink_to(tmp_path / "gone" / "distmm.yaml")
    return folder


def test_an_unreadable_yaml_file_is_named(tmp_path):
    """dask skips a config file it cannot open (an OSError) without a word: the settings in
    it were not in force and nothing said so."""
    folder = _config_folder(tmp_path)
    probe = ("import warnings, numpy as np, distmm\n"
             "with warnings.catch_warnings(record=True) as seen:\n"
             "    warnings.simplefilter('always')\n"
             "    np.testing.assert_array_equal(distmm.matmul(np.ones((3, 5)), "
             "np.ones((5, 2))), 5.0)\n"
             "    distmm.config.get_config()\n"
             "assert distmm.config.get_config().batch_stripes == 5\n"
             "print('\\n'.join(f'{w.category.__name__}: {w.message}' for w in seen))\n")
    env = {k: v for k, v in {**os.environ, **_CLEAN, "DASK_CONFIG": str(folder)}.items()
           if v is not None}
    res = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines() == [
        f"RuntimeWarning: distmm configuration: the dask config file {folder / 'distmm.yaml'} "
        f"cannot be read (No such file or directory); dask skips it, so none of its settings "
        f"is in force"], res.stdout


@pytest.mark.slow  # a command, ~2 s
def test_an_unreadable_yaml_file_at_the_command_line_is_one_line(tmp_path):
    folder = _config_folder(tmp_path)
    res = run_cli("plan", 64, 64, 64, cwd=tmp_path, timeout=120,
                  env={**_CLEAN, "DASK_CONFIG": str(folder)})
    assert res.returncode == 0, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"distmm plan: warning: distmm configuration: the dask config file "
        f"{folder / 'distmm.yaml'} cannot be read (No such file or directory); dask skips it, "
        f"so none of its settings is in force"], res.stderr
    assert "C[64, 64] = A[64, 64] @ B[64, 64]" in res.stdout


@pytest.mark.parametrize("key, value, field", [
    ("tile", np.int64(48), 48),
    ("tile", [np.int64(48), np.int32(32), np.uint16(16)], (48, 32, 16)),
    ("tile", np.array([48, 32, 16]), (48, 32, 16)),
    ("local-threads", np.int64(2), 2),
    ("batch-stripes", np.uint8(3), 3),
    ("retry-timeout", np.int64(5), 5.0),
    ("device-keep", np.float32(0.5), 0.5),
    ("mpi-join-timeout", np.int16(9), 9.0),
    ("direct-writes", np.bool_(False), False),
    ("progress", np.bool_(False), False),
    ("engine", np.str_("local"), "local"),
])
def test_a_numpy_scalar_is_the_number_it_holds(key, value, field):
    """A computed setting (``np.int64``, ``np.float32``, ``np.bool_``) was refused as "a
    positive integer is needed", "a duration is needed" or "true or false is needed", naming
    the very thing given, where memory-budget and pinned-pool took it."""
    with dask.config.set({f"distmm.{key}": value}):
        assert getattr(get_config(), key.replace("-", "_")) == field
        a = np.random.default_rng().standard_normal((9, 7))
        np.testing.assert_allclose(distmm.matmul(a, a.T, engine="local"), a @ a.T,
                                   rtol=1e-12, atol=1e-12)
    with dask.config.set({f"distmm.{key}": [value, value]}):
        with pytest.raises(ValueError, match=f"distmm\\.{key} = "):
            get_config()


@pytest.mark.parametrize("first, then, words", [
    # numpy's 'The truth value of an array with more than one element is ambiguous', from the
    # cache's comparison of np.int64(2**30) with [1, 2]
    (np.int64(2**30), [1, 2], "distmm.memory-budget = [1, 2] is not valid: not a size"),
    # np.int64(2**30) == np.array([2**30]) is true: the cached budget was used as in force
    (np.int64(2**30), np.array([2**30]), "distmm.memory-budget = array([1073741824]) is not "
                                         "valid: not a size"),
])
def test_a_numpy_value_in_force_before_a_bad_one(first, then, words):
    a = np.ones((3, 3))
    with dask.config.set({"distmm.memory-budget": first}):
        distmm.matmul(a, a, engine="local")
    with dask.config.set({"distmm.memory-budget": then}):
        with pytest.raises(ValueError) as info:
            distmm.matmul(a, a, engine="local")
    assert words in str(info.value), str(info.value)
    np.testing.assert_array_equal(distmm.matmul(a, a, engine="local"), 3.0)


def test_an_array_set_over_a_variable_is_one_config_error(monkeypatch):
    """Comparing a variable's [64, 64] with the array set over it must not be numpy's 'truth
    value of an array ... is ambiguous'."""
    monkeypatch.setenv("DISTMM_TILE", "[64, 64]")
    with dask.config.set({"distmm.tile": np.array([64, 64])}):
        with pytest.raises(ValueError) as info:
            get_config()
    message = str(info.value)
    assert "distmm.tile = array([64, 64]) is not valid: a tile is an int or three ints" \
        in message and "from the environment variable" not in message, message
