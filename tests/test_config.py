"""distmm's configuration: every form of setting a key, checking values, the
per-change cache, and the memory budget that follows what the process has.

Covers: ``dask.config.set`` (hyphen and underscore spellings, nested contexts,
refresh), a YAML file found through ``DASK_CONFIG``, ``DASK_DISTMM__<KEY>`` and
``DISTMM_<KEY>`` (fresh processes, since dask and distmm read the environment
when imported) with their precedence, one ``ValueError`` naming the key for a
bad value or an unknown key, and ``memory_budget`` explicit, automatic in a
plain process and automatic inside a real LocalCluster worker with a 1 GiB
memory limit.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dask.config

import distmm
from conftest import run_cli
from distmm import config as config_mod
from distmm.api import plan_for
from distmm.config import KEYS, get_config, memory_budget

MiB = 2**20


def test_yaml_keys_and_parsers_agree():
    assert set(KEYS) == set(config_mod._PARSERS)


def test_backend_names_are_the_executors():
    from distmm.executor import BACKENDS
    assert config_mod.BACKEND_NAMES == BACKENDS


def test_defaults():
    cfg = get_config()
    assert cfg.engine == "auto" and cfg.backend == "auto" and cfg.tile is None
    assert cfg.memory_budget is None and cfg.memory_budget_from == "auto"
    assert cfg.pinned_pool == 2 * 1024**3 and cfg.retry_timeout == 60.0
    assert cfg.device_keep == 2.0
    with dask.config.set({"distmm.device-keep": 0}):
        assert get_config().device_keep == 0.0  # 0: freed at once



def test_dask_config_set_round_trips_and_nests():
    before = get_config()
    with dask.config.set({"distmm.memory-budget": "1GiB", "distmm.tile": [64, 32, 16]}):
        cfg = get_config()
        assert cfg.memory_budget == 2**30 and cfg.memory_budget_from == "config"
        assert cfg.tile == (64, 32, 16)
        with dask.config.set({"distmm.memory_budget": "3MiB"}):  # dask's underscore spelling
            assert get_config().memory_budget == 3 * MiB
            assert memory_budget() == 3 * MiB
            with dask.config.set({"distmm.retry-timeout": "2 minutes", "distmm.progress": "false"}):
                inner = get_config()
                assert inner.retry_timeout == 120.0 and inner.progress is False
                assert inner.memory_budget == 3 * MiB
            assert get_config().retry_timeout == 60.0
        assert get_config().memory_budget == 2**30
        assert get_config().tile == (64, 32, 16)
    after = get_config()
    assert after == before and after.memory_budget is None and after.tile is None


def test_cache_returns_the_same_object_until_the_section_changes():
    first = get_config()
    assert get_config() is first
    with dask.config.set({"distmm.local-threads": 1}):
        assert get_config().local_threads == 1
    assert get_config().local_threads is None
    # a value changed in place inside the section is seen too
    with dask.config.set({"distmm.tile": [64, 64, 64]}):
        assert get_config().tile == (64, 64, 64)
        dask.config.config["distmm"]["tile"][0] = 32
        assert get_config().tile == (32, 64, 64)


def test_cache_is_not_left_stale_by_a_block_another_thread_leaves(monkeypatch):
    """Another thread leaving its dask.config.set block while this one parses the section:
    the next call sees the change (the cache once paired the new section with the old
    parse, so every later call kept precision='tf32')."""
    import threading

    ctx = dask.config.set({"distmm.precision": "tf32"})
    ctx.__enter__()
    left = False
    real = config_mod._read

    def parse_then_other_thread_leaves(section):
        nonlocal left
        cfg = real(section)
        if not left:
            left = True
            t = threading.Thread(target=ctx.__exit__, args=(None, None, None))
            t.start()
            t.join()
        return cfg

    try:
        monkeypatch.setattr(config_mod, "_cache", None)
        monkeypatch.setattr(config_mod, "_read", parse_then_other_thread_leaves)
        assert get_config().precision == "tf32"  # what was in force when it was read
    finally:
        if not left:
            ctx.__exit__(None, None, None)
    monkeypatch.setattr(config_mod, "_read", real)
    assert dask.config.get("distmm.precision") == "highest"
    assert get_config().precision == "highest"


def test_the_configured_engine_is_the_default_one():
    """``distmm.engine`` decides where ``engine="auto"`` (the default) goes; an explicit
    ``engine=`` wins (the key was parsed but never read before)."""
    a = np.random.default_rng().standard_normal((40, 30))
    with dask.config.set({"distmm.engine": "dask"}):
        for call in (lambda: distmm.matmul(a, a.T), lambda: distmm.gemm(a, a.T)):
            with pytest.raises(ValueError, match="engine='dask' needs a distributed.Client"):
                call()
        np.testing.assert_allclose(distmm.matmul(a, a.T, engine="local"), a @ a.T)
    with dask.config.set({"distmm.engine": "local"}):
        np.testing.assert_allclose(distmm.matmul(a, a.T), a @ a.T)


def test_refresh_keeps_the_defaults():
    saved = copy.deepcopy(dask.config.config)
    try:
        with dask.config.set({"distmm.retry-timeout": 5}):
            assert get_config().retry_timeout == 5.0
            dask.config.refresh()
            cfg = get_config()
            assert cfg.memory_budget_from == "auto" and cfg.retry_timeout == 60.0
    finally:  # other tests' settings (a default client's scheduler...) come back
        dask.config.config.clear()
        dask.config.config.update(saved)


@pytest.mark.parametrize("key, value, words", [
    ("memory-budget", "lots", "distmm.memory-budget"),
    ("memory-budget", 0, "distmm.memory-budget"),
    ("tile", [64, 64], "distmm.tile"),
    ("tile", -4, "distmm.tile"),
    ("engine", "spark", "distmm.engine"),
    ("backend", "magic", "distmm.backend"),
    ("retry-timeout", -1, "distmm.retry-timeout"),
    ("retry-timeout", "soon", "distmm.retry-timeout"),
    ("progress", "maybe", "distmm.progress"),
    ("local-threads", 0, "distmm.local-threads"),
    ("pinned-pool", "-1GB", "distmm.pinned-pool"),
    ("device-keep", -1, "distmm.device-keep"),
    ("device-keep", "a while", "distmm.device-keep"),
    ("memory-bugdet", "1GiB", "unknown key 'distmm.memory-bugdet'"),
])
def test_a_bad_value_is_one_value_error_naming_the_key(key, value, words):
    with dask.config.set({f"distmm.{key}": value}):
        with pytest.raises(ValueError, match=words.replace(".", r"\.")):
            get_config()
        with pytest.raises(ValueError, match=words.replace(".", r"\.")):
            distmm.matmul(np.ones((2, 2)), np.ones((2, 2)))
    get_config()  # fine again once the context is gone


@pytest.mark.parametrize("key, value, reason", [
    # the planner's limit, met before: 'workers must be at most 131072', naming no key
    ("local-threads", 10**6, "must be at most 131072"),
    # dask's parse_timedelta read '-2s' as '1-2': 'could not convert string to float'
    ("device-keep", "-2s", "must be a duration of at least 0"),
    ("device-keep", -1, "must be a duration of at least 0"),
    ("retry-timeout", "-5s", "must be a positive, finite duration"),
    # null is no value for it ('true, false or null is needed' said it was)
    ("direct-writes", "maybe", "true or false is needed"),
    ("tile", [64, 64, -1], "three positive integers [tm, tn, tk] are needed"),
    # dask's parsers raised these bare: IndexError, AttributeError, OverflowError
    ("device-keep", [1, 2], "a duration is needed (seconds or a string such as '60s')"),
    ("mpi-join-timeout", {"a": 1}, "a duration is needed (seconds or a string such as '60s')"),
    ("mpi-join-warning", "1e400", "must be a positive, finite duration"),
    ("memory-budget", "1e400", "not a finite size"),
    ("pinned-pool", "1e400 GiB", "not a finite size"),
    # a threading.Timer that long (device-keep) failed in its thread: 'timestamp out of range'
    ("device-keep", 10**21, "must be at most 9.22337e+09 s"),
])
def test_a_bad_value_says_what_is_wrong_with_it(key, value, reason):
    with dask.config.set({f"distmm.{key}": value}):
        with pytest.raises(ValueError) as info:
            distmm.matmul(np.ones((2, 2)), np.ones((2, 2)), engine="local")
    message = str(info.value)
    assert f"distmm.{key} = {value!r} is not valid: {reason} (" in message, message


# ---------------------------------------------------------------- environment and YAML

_PROBE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import dask.config
    import distmm
    from distmm.api import plan_for
    from distmm.config import get_config, memory_budget
    a = np.random.default_rng(0).standard_normal((9, 7))
    ok = bool(np.allclose(distmm.matmul(a, a.T), a @ a.T))  # the call that raised KeyError
    cfg = get_config()
    out = {"ok": ok, "budget": cfg.memory_budget, "from": cfg.memory_budget_from,
           "tile": cfg.tile, "retry": cfg.retry_timeout,
           "plan_budget": plan_for(100, 100, 100, "float64", workers=1).memory_budget}
    dask.config.refresh()  # re-reads YAML and DASK_* variables: DISTMM_* must survive it
    out["after_refresh"] = get_config().memory_budget
    with dask.config.set({"distmm.memory-budget": "1MiB"}):
        out["set_wins"] = get_config().memory_budget
    print(json.dumps(out))
""")


def _probe(tmp_path, env_extra: dict, yaml_text: str | None = None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DASK_DISTMM__", "DISTMM_")) and k != "DASK_CONFIG"}
    if yaml_text is not None:
        folder = tmp_path / "dask-config"
        folder.mkdir(exist_ok=True)
        (folder / "distmm.yaml").write_text(yaml_text)
        env["DASK_CONFIG"] = str(folder)
    env.update(env_extra)
    res = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    return res


def _probe_ok(tmp_path, env_extra: dict, yaml_text: str | None = None) -> dict:
    res = _probe(tmp_path, env_extra, yaml_text)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["ok"] and out["set_wins"] == MiB
    return out


@pytest.mark.parametrize("env, yaml_text, budget", [
    ({"DASK_DISTMM__MEMORY_BUDGET": "3MiB"}, None, 3 * MiB),
    ({"DISTMM_MEMORY_BUDGET": "5MiB"}, None, 5 * MiB),
    ({}, "distmm:\n  memory-budget: 7MiB\n  tile: [64, 64, 32]\n  retry-timeout: 90s\n", 7 * MiB),
    # precedence: YAML < DISTMM_ < DASK_DISTMM__ (< dask.config.set, checked in every probe)
    ({"DISTMM_MEMORY_BUDGET": "5MiB"}, "distmm:\n  memory-budget: 7MiB\n", 5 * MiB),
    ({"DISTMM_MEMORY_BUDGET": "5MiB", "DASK_DISTMM__MEMORY_BUDGET": "3MiB"},
     "distmm:\n  memory-budget: 7MiB\n", 3 * MiB),
    # an empty variable is no setting (it was refused: 'a size is needed'), whichever form
    ({"DISTMM_MEMORY_BUDGET": ""}, "distmm:\n  memory-budget: 7MiB\n", 7 * MiB),
    ({"DASK_DISTMM__MEMORY_BUDGET": " "}, "distmm:\n  memory-budget: 7MiB\n", 7 * MiB),
    ({"DISTMM_MEMORY_BUDGET": "5MiB", "DASK_DISTMM__MEMORY_BUDGET": ""}, None, 5 * MiB),
], ids=["dask-env", "distmm-env", "yaml", "distmm-env-over-yaml", "dask-env-over-distmm-env",
        "empty-distmm-env", "empty-dask-env", "empty-dask-env-over-distmm-env"])
@pytest.mark.slow
def test_environment_and_yaml(tmp_path, env, yaml_text, budget):
    out = _probe_ok(tmp_path, env, yaml_text)
    assert out["budget"] == budget and out["from"] == "config"
    assert out["plan_budget"] == budget
    assert out["after_refresh"] == budget
    if yaml_text and "tile" in yaml_text:
        assert out["tile"] == [64, 64, 32] and out["retry"] == 90.0


@pytest.mark.slow  # two commands, ~4 s
def test_empty_variables_are_no_settings_at_the_command_line(tmp_path):
    """``DISTMM_<KEY>=`` for every key (an exported, empty variable in a job script) is as
    if none were set: the product runs with the defaults (``DISTMM_MEMORY_BUDGET=`` was
    refused, status 2), and a YAML file's setting stays in force (an empty
    ``DISTMM_DEVICE_MEMORY_LIMIT`` had replaced it with null)."""
    res = _cli_with(tmp_path, **{f"DISTMM_{k.upper().replace('-', '_')}": "" for k in KEYS})
    assert res.returncode == 0, res.stderr
    assert np.array_equal(np.load(tmp_path / "c.npy"), np.full((3, 3), 3.0))
    yaml_file = tmp_path / "dask-config" / "distmm.yaml"
    yaml_file.write_text("distmm:\n  device-memory-limit: 1GiB\n")
    clean = {k: None for k in os.environ if k.startswith(("DASK_DISTMM", "DISTMM_"))}
    info = run_cli("info", cwd=tmp_path, timeout=120,
                   env={**clean, "DASK_CONFIG": str(yaml_file.parent),
                        "DISTMM_DEVICE_MEMORY_LIMIT": "", "DISTMM_MEMORY_BUDGET": "",
                        "DASK_DISTMM__DEVICE_MEMORY_LIMIT": "",  # info showed it empty
                        "DISTMM_BATCH_STRIPES": " "})
    assert info.returncode == 0, info.stderr
    assert [x for x in info.stdout.splitlines() if x.startswith("config")] == [
        f"config      device-memory-limit = 1GiB ({yaml_file})"], info.stdout


def test_other_distmm_variables_are_not_keys(tmp_path):
    # DISTMM_CACHE_DIR and friends are read by their own modules, not as configuration
    out = _probe_ok(tmp_path, {"DISTMM_CACHE_DIR": str(tmp_path), "DISTMM_TILE": "[64, 64, 32]"})
    assert out["tile"] == [64, 64, 32] and out["from"] == "auto"


def test_a_bad_environment_value_names_the_key(tmp_path):
    res = _probe(tmp_path, {"DASK_DISTMM__MEMORY_BUDGET": "lots"})
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    # distmm.errors.ConfigError, a ValueError
    assert last.startswith("distmm.errors.ConfigError") and "distmm.memory-budget" in last, last
    assert "DASK_DISTMM__MEMORY_BUDGET" in last and "KeyError" not in res.stderr


@pytest.mark.parametrize("env, words", [
    # a misspelt DISTMM_ shorthand was ignored: the run went on with the default, status 0
    ({"DISTMM_MEMORY_BUDGTE": "1GiB"},
     ["unknown key 'distmm.memory_budgte'", "DISTMM_MEMORY_BUDGTE",
      "did you mean distmm.memory-budget?"]),
    # a blank duration ended in 'error: IndexError: string index out of range', status 1
    ({"DISTMM_RETRY_TIMEOUT": "x"},
     ["distmm.retry-timeout = 'x' is not valid: not a duration"]),
], ids=["misspelt-shorthand", "bad-duration"])
@pytest.mark.slow
def test_a_bad_environment_setting_is_one_line_and_status_2(tmp_path, env, words):
    clean = {k: None for k in os.environ if k.startswith(("DASK_DISTMM__", "DISTMM_"))}
    res = run_cli("plan", 64, 64, 64, env={**clean, "DASK_CONFIG": None, **env}, timeout=120,
                  cwd=tmp_path)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "Traceback" not in res.stderr and not res.stdout
    for w in words:
        assert w in res.stderr, res.stderr
    # a near name of another of distmm's variables, not a key, is left alone
    ok = run_cli("plan", 64, 64, 64, timeout=120, cwd=tmp_path,
                 env={**clean, "DASK_CONFIG": None, "DISTMM_BATCH_STRIPE_PAUSE": "x"})
    assert ok.returncode == 0, ok.stderr


def test_none_in_the_environment_is_null_and_the_choices_are_named(tmp_path):
    """dask reads 'none' in the environment as YAML's null; a key of named choices said
    "= None is not valid: a name is needed", neither the user's spelling nor the choices."""
    res = _probe(tmp_path, {"DISTMM_BATCH_PANELS": "none"})
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode != 0 and ("distmm.batch-panels = null is not valid: one of auto, "
                                    "read, share, broadcast is needed (") in last, last


# ---------------------------------------------------------------- memory budget

def test_explicit_budget_is_used_as_given():
    with dask.config.set({"distmm.memory-budget": 123456789}):
        assert memory_budget() == 123456789 and memory_budget(on_gpu=True) == 123456789
        plan = plan_for(2000, 2000, 2000, "float64", workers=1)
        assert plan.memory_budget == 123456789
        # an engine's hint lowers it, never raises it
        assert plan_for(2000, 2000, 2000, "float64", workers=1,
                        hints={"memory_budget": 1000}).memory_budget == 1000
        assert plan_for(2000, 2000, 2000, "float64", workers=1,
                        hints={"memory_budget": 10**12}).memory_budget == 123456789


def test_auto_budget_follows_available_memory():
    import psutil

    cfg = get_config()
    assert cfg.memory_budget_from == "auto"
    budget = memory_budget()
    available = psutil.virtual_memory().available
    assert 64 * MiB <= budget <= max(available, 64 * MiB)
    assert budget % (64 * MiB) == 0
    assert plan_for(100, 100, 100, "float64", workers=1).memory_budget == budget
    # fewer local threads: each task may hold more
    with dask.config.set({"distmm.local-threads": 1}):
        one = memory_budget()
    assert one >= budget


def _budget_on_worker():
    from distmm.config import get_config, memory_budget

    return memory_budget(), get_config().memory_budget_from


def test_auto_budget_on_a_worker_follows_its_memory_limit():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=True,
                                  dashboard_address=":0", memory_limit="1GiB") as cluster:
        with distributed.Client(cluster) as client:
            budget, source = client.submit(_budget_on_worker, pure=False).result(timeout=60)
    assert source == "auto"
    assert 0 < budget <= 2**30
    assert budget == int(2**30 * config_mod.WORKER_FRACTION / 2)  # split between 2 threads


def test_gpu_budget_without_a_gpu_falls_back_to_the_host():
    # a GPU backend asked for on a machine without cupy fails in the executor, with its
    # install hint, not in the memory budget; with cupy and a device this is the GPU's share
    try:
        import cupy
        pytest.skip(f"cupy {cupy.__version__} is installed: the GPU's own budget applies")
    except ImportError:
        pass
    # the host's available memory moves between two reads (other processes), so allow a
    # little drift; a GPU's free memory would be a different figure altogether
    gpu, host = memory_budget(on_gpu=True), memory_budget(on_gpu=False)
    assert abs(gpu - host) <= 0.1 * host, (gpu, host)
    from distmm.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match="distmm\\[gpu\\]"):
        distmm.matmul(np.ones((4, 4)), np.ones((4, 4)), backend="raw")


@pytest.mark.parametrize("key", KEYS)
def test_an_empty_setting_is_no_setting(key):
    """An empty value of any key is no setting: the key keeps what it had without it
    (``DISTMM_DEVICE_MEMORY_LIMIT=`` had been a limit of one byte; ``memory-budget``,
    ``pinned-pool``, durations, names, numbers and ``direct-writes`` refused it, while
    ``device-memory-limit`` and ``progress`` took it as null over a YAML file's value)."""
    field = key.replace("-", "_")
    unset = getattr(config_mod._read(config_mod._defaults["distmm"]), field)
    for blank in ("", "  "):
        with dask.config.set({f"distmm.{key}": blank}):
            assert getattr(get_config(), field) == unset


# ---------------------------------------------------------------- bad values, three ways

@pytest.mark.parametrize("key", ["local-threads", "batch-stripes", "tile"])
def test_a_number_in_other_digits_names_the_key(key):
    """'²' passed str.isdigit() and then failed int(): 'invalid literal for int() with base
    10', naming no key (at the command line too, from DISTMM_LOCAL_THREADS=²)."""
    with dask.config.set({f"distmm.{key}": "²"}):
        with pytest.raises(ValueError, match=f"distmm\\.{key} = '²' is not valid: "):
            distmm.matmul(np.ones((3, 3)), np.ones((3, 3)))


def test_a_fraction_of_a_byte_is_refused_however_it_is_spelt():
    """A YAML file's or dask.config.set's '1.5' was taken as 1 byte (parse_bytes truncates),
    where the environment's 1.5 (a float to dask) was refused."""
    for value in ("1.5", 1.5, " 0.5 "):
        with dask.config.set({"distmm.memory-budget": value}):
            with pytest.raises(ValueError, match="a whole number of bytes is needed"):
                distmm.matmul(np.ones((3, 3)), np.ones((3, 3)))
    for value, nbytes in (("1e9", 10**9), ("1.5GiB", 3 * 2**29), ("10 MB", 10**7), (" 64 ", 64)):
        with dask.config.set({"distmm.memory-budget": value}):
            assert get_config().memory_budget == nbytes
    with dask.config.set({"distmm.pinned-pool": "inf"}):
        with pytest.raises(ValueError, match="distmm.pinned-pool = 'inf' is not valid: not a "
                                             "finite size"):
            get_config()


def test_an_empty_distmm_section_is_the_defaults():
    """`distmm:` with every key commented out is null; after dask.config.refresh() (and in a
    dask.config.set of the section) it failed naming a key never set: 'distmm.engine = null
    is not valid'."""
    with dask.config.set({"distmm": None}):
        assert get_config() == config_mod._read(config_mod._defaults["distmm"])
        np.testing.assert_array_equal(distmm.matmul(np.ones((3, 3)), np.ones((3, 3))), 3.0)


def _cli_with(tmp_path, yaml_text: str | None = None, **env):
    """``distmm matmul a.npy b.npy -o c.npy`` with a dask YAML file and variables."""
    np.save(tmp_path / "a.npy", np.ones((3, 3)))
    np.save(tmp_path / "b.npy", np.ones((3, 3)))
    clean = {k: None for k in os.environ if k.startswith(("DASK_DISTMM", "DISTMM_"))}
    folder = tmp_path / "dask-config"
    folder.mkdir()
    if yaml_text is not None:
        (folder / "distmm.yaml").write_text(yaml_text)
    return run_cli("matmul", "a.npy", "b.npy", "-o", "c.npy", cwd=tmp_path, timeout=120,
                   env={**clean, "DASK_CONFIG": str(folder), **env})


@pytest.mark.parametrize("yaml_text, env", [
    ("distmm:\n  - memory-budget: 4GiB\n", {}),  # a list of one mapping
    (None, {"DASK_DISTMM": "5"}),
], ids=["yaml-list", "dask-distmm-variable"])
def test_a_distmm_section_that_is_no_mapping_fails_before_any_work(tmp_path, yaml_text, env):
    """Dropped for the defaults when distmm was imported (update_defaults), so the setting
    was silently ignored and the product ran, status 0; after dask.config.refresh() it
    failed. Now one line from the first call, naming where it came from."""
    res = _cli_with(tmp_path, yaml_text, **env)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "'distmm' must be a mapping of keys" in res.stderr and "Traceback" not in res.stderr
    where = (f"the dask YAML file {tmp_path / 'dask-config' / 'distmm.yaml'}" if yaml_text
             else "the environment variable DASK_DISTMM")
    assert where in res.stderr, res.stderr
    assert not (tmp_path / "c.npy").exists()


@pytest.mark.parametrize("yaml_text, words", [
    ("distmm:\n  tile: [64, 64]\n", "distmm.tile = [64, 64] is not valid: "),
    ("distmm:\n  memory_budjet: 1GiB\n", "unknown key 'distmm.memory_budjet' ("),
], ids=["bad-value", "unknown-key"])
def test_a_bad_setting_in_a_yaml_file_names_the_file(tmp_path, yaml_text, words):
    """The message named the key and the ways to set it, never which of the YAML files in
    dask's config paths (/etc/dask, ~/.config/dask, $DASK_CONFIG) held it."""
    res = _cli_with(tmp_path, yaml_text)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert words in res.stderr, res.stderr
    assert f"the dask YAML file {tmp_path / 'dask-config' / 'distmm.yaml'}" in res.stderr
    assert not (tmp_path / "c.npy").exists()
