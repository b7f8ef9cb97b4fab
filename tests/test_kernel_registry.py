"""The kernel registry agrees with the CUDA sources, and every source compiles with nvcc
for sm_90 and sm_80 (skipped without nvcc); a tuning cache's entries are used only where they
are configurations ``distmm tune`` could have stored for this distmm's kernel, else ignored
with one warning. No GPU needed, but for the GPU executor's use of the cache (``gpu``)."""
from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

import distmm  # noqa: F401  (aliases kernels/ as distmm.kernels in a source checkout)
import distmm.executor.registry as registry
from distmm.executor import tuning
from distmm.executor import cuda_loader
from distmm.kernels import CUDA_DIR

NVCC = shutil.which("nvcc") or (shutil.which("/usr/local/cuda/bin/nvcc"))
CU_FILES = sorted(p.name for p in CUDA_DIR.glob("*.cu"))


def test_every_source_is_registered_once_and_steps_are_consecutive():
    every = registry.steps() + registry.tc_steps()
    files = [k.file for k in every]
    assert sorted(files + [cuda_loader.FIXUP_FILE]) == CU_FILES
    assert [k.step for k in every] == list(range(1, len(files) + 1))
    for k in every:
        assert k.file.startswith(f"{k.step:02d}_")


@pytest.mark.parametrize("spec", registry.steps(), ids=lambda k: k.name)
def test_template_names_a_kernel_in_its_file(spec):
    text = (CUDA_DIR / spec.file).read_text()
    entry = spec.template.split("<")[0]
    assert entry == f"distmm_gemm_{spec.name}"
    assert re.search(rf"__global__[^;{{]*\b{entry}\s*\(", text), f"{entry} not in {spec.file}"
    fields = set(re.findall(r"{(\w+)}", spec.template))
    expected = {"T"} | ({"TA", "TB"} if spec.layout_template else set())
    for dt in spec.dtypes:
        expected_dt = expected | set(spec.params(dt))
        assert fields == expected_dt


@pytest.mark.parametrize("dtype", registry.DTYPES)
@pytest.mark.parametrize("spec", registry.steps(), ids=lambda k: k.name)
def test_defaults_are_valid(spec, dtype):
    p = spec.params(dtype)
    assert spec.violations(dtype, p, 90) == []
    assert spec.violations(dtype, p, 80) == []
    assert spec.threads(p) <= 1024
    expr = spec.name_expression(dtype, p, True, False)
    assert registry.C_TYPES[dtype] in expr


def test_tuning_space_is_valid_and_nonempty():
    spec = registry.best_kernel()
    assert spec.tunable
    for dt in ("float32", "float64"):
        cands = spec.candidates(dt)
        assert len(cands) > 10
        assert cands[0] == spec.params(dt)
        for p in cands:
            assert spec.violations(dt, p) == []


def test_violations_catch_bad_configs():
    spec = registry.get("warptile")
    bad = dict(spec.params("float32"), WM=48)
    assert spec.violations("float32", bad)
    big = dict(spec.params("float64"), BM=256, BN=256, BK=32, STAGES=4)
    assert any("shared memory" in v for v in spec.violations("float64", big, 80))
    assert spec.violations("float32", spec.params("float32"), 75)  # cp.async needs sm_80


def test_smem_matches_the_pipelined_layout():
    spec = registry.get("warptile")
    p = {"BM": 128, "BN": 128, "BK": 16, "STAGES": 3, "WM": 32, "WN": 64, "TM": 8, "TN": 8}
    # A: 128 rows of 16 (+4 pad) floats; B: 16 rows of 128 floats; 3 stages
    assert spec.smem_bytes("float32", p, False, False) == 3 * (128 * 20 + 16 * 128) * 4
    # transposed A: 16 rows of 128; transposed B: 128 rows of 16 + 4
    assert spec.smem_bytes("float32", p, True, True) == 3 * (16 * 128 + 128 * 20) * 4
    assert spec.smem_bytes("float64", p, False, False) == 3 * (128 * 18 + 16 * 128) * 8


def test_dmma_float64_layout_and_constraints():
    """Step 9 runs float64 on DMMA tiles: rows padded by 4 doubles, TM fixed at 8, and the
    other dtypes keep step 8's layout and constraints."""
    spec = registry.get("dmma")
    p = {"BM": 128, "BN": 128, "BK": 16, "STAGES": 3, "WM": 32, "WN": 64, "TM": 8, "TN": 8, "MINB": 1}
    assert spec.smem_bytes("float64", p, False, False) == 3 * (128 * 20 + 16 * 132) * 8
    assert spec.smem_bytes("float64", p, True, True) == 3 * (16 * 132 + 128 * 20) * 8
    assert spec.smem_bytes("float32", p, False, False) == registry.get("warptile").smem_bytes(
        "float32", p, False, False)
    assert spec.violations("float64", p) == []
    assert spec.violations("float64", dict(p, TM=16, TN=4))  # the same warp tile named twice
    assert spec.violations("float32", dict(p, TM=16, TN=4)) == []
    assert spec.violations("float64", dict(p, MINB=2))  # 64 accumulators need > 128 registers
    assert registry.best_kernel() is spec
    for dt in registry.DTYPES:
        assert spec.violations(dt, spec.params(dt)) == []


def test_grid_dims():
    w = registry.get("warptile")
    p = dict(w.params("float32"), BM=128, BN=128)
    assert w.grid_dims(1000, 300, p) == (8 * 3, 1, 1)
    n = registry.get("naive")
    assert n.grid_dims(9, 33, {}) == (2, 2, 1)
    with pytest.raises(ValueError):
        n.grid_dims(8 * 70000, 1, {})


@pytest.mark.parametrize("m, n, bm, bn", [(8192, 8192, 64, 128), (1000, 33, 64, 128),
                                         (4097, 4097, 128, 64), (64 * 9 + 1, 128 * 3, 64, 128)])
def test_grouped_tile_origins_cover_every_tile_once(m, n, bm, bn):
    tiles = -(-m // bm) * -(-n // bn)
    m0, n0 = cuda_loader.grouped_tile_origins(m, n, bm, bn, np.arange(tiles))
    assert len(set(zip(m0.tolist(), n0.tolist()))) == tiles
    assert m0.min() == 0 and n0.min() == 0 and m0.max() < m and n0.max() < n
    assert (m0 % bm == 0).all() and (n0 % bn == 0).all()
    # row tiles are swept in groups of 8: the first 8 tiles share column 0
    assert (n0[:min(8, -(-m // bm))] == 0).all()


def test_defines_must_be_distmm_macros():
    """Compile-time variants (``defines=``) are checked before anything is compiled."""
    with pytest.raises(ValueError, match="DISTMM_"):
        cuda_loader.get_kernel("simt_fp64", "float64", defines={"NDEBUG": 1})
    with pytest.raises(ValueError):
        cuda_loader.get_kernel("simt_fp64", "float64", defines={"DISTMM_SIMT_KPAIRS": "two"})


def test_split_tail_plan():
    plan = cuda_loader.split_tail_plan
    assert plan(8192, 264, 512) == (8, 33)    # 8192^2 on 132 SMs x 2: 8 tiles in the last wave
    assert plan(32768, 264, 1024) == (32, 8)  # 16384^2
    assert plan(2048, 264, 256) == (0, 1)     # 4096^2: 200 tiles, no room to split them
    assert plan(528, 264, 512) == (0, 1)      # whole waves
    assert plan(16, 264, 257) == (16, 16)     # few tiles, long k: split-K
    assert plan(16, 264, 20) == (16, 5)       # at least 4 k tiles a range
    assert plan(1, 264, 1) == (0, 1) and plan(0, 264, 10) == (0, 1)
    assert plan(3, 264, 10000) == (3, 64)     # at most 64 ranges


def test_tuning_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTMM_CACHE_DIR", str(tmp_path))
    assert tuning.load_tuning_for("GPU X") == {} and tuning.tuning_for("GPU X") == {}
    entry = {"kernel": "warptile", "params": registry.get("warptile").params("float32"),
             "prefer": {"large": "raw"}}
    path = tuning.store_tuning("GPU X", np.float32, entry)
    assert path.parent == tmp_path
    assert tuning.load_tuning_for("GPU X")["float32"] == entry
    # the in-process copy the executor reads is refreshed by a store in this process
    assert tuning.tuning_for("GPU X")["float32"] == entry
    # a tuned config that breaks the constraints falls back to the defaults
    spec = registry.get("warptile")
    assert registry.kernel_params(spec, "float32", dict(entry["params"], WM=48)) == spec.params("float32")
    path.write_text("{not json")
    assert tuning.load_tuning_for("GPU X") == {}
    # ... but not by another writer: the file is read once per process
    assert tuning.tuning_for("GPU X")["float32"] == entry


@pytest.mark.parametrize("text, why", [("{not json", "tune.json:1: not JSON"),
                                       ('{"version": 2, "gpus": {}}', "cache version 2"),
                                       ('{"version": 1, "gpus": {"GPU X": [1]}}', "'gpus'")])
def test_a_cache_file_the_executor_cannot_use_is_named_once(tmp_path, monkeypatch, caplog,
                                                            text, why):
    """The executor's read of the cache (``tuning_for``): a file there that is no cache of
    this version reads as empty, as before, but is named in one warning (it read as empty
    without a word: a hand-edited cache that broke left every kernel untuned silently)."""
    import logging

    monkeypatch.setenv("DISTMM_CACHE_DIR", str(tmp_path))
    (tmp_path / "tune.json").write_text(text)
    with caplog.at_level(logging.WARNING, logger="distmm.executor.tuning"):
        assert tuning.tuning_for("GPU X") == {} and tuning.tuning_for("GPU X") == {}
    (said,) = [r.getMessage() for r in caplog.records]
    assert "the tuning cache is not used" in said and why in said, said
    assert str(tmp_path / "tune.json") in said and "defaults" in said


@pytest.mark.parametrize("text", ["{not json", '{"version": 2, "gpus": {}}', '[1, 2]',
                                  '{"version": 1, "gpus": {"GPU X": [1]}}'])
def test_store_tuning_leaves_a_file_that_is_not_a_cache(tmp_path, text):
    """A store refuses, as ``distmm tune`` does, to replace what it cannot read as a cache
    of its version (another distmm's newer cache, a file the user pointed at by mistake)."""
    path = tmp_path / "tune.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="tune.json"):
        tuning.store_tuning("GPU X", np.float32, {"kernel": "warptile"}, path)
    assert path.read_text() == text and sorted(tmp_path.iterdir()) == [path]


def test_source_inlines_headers():
    """Every step's local headers are inlined, the tensor-core steps' too, whatever follows
    an include on its line."""
    for spec in [*registry.steps(), *registry.tc_steps()]:
        text = cuda_loader.source(spec.file)
        assert '#include "' not in text, spec.file
        assert "namespace distmm" in text
    assert cuda_loader._INCLUDE.sub("", '#include "a.cuh"  // why\n#include "b.cuh"\n') == "\n\n"


@pytest.mark.parametrize("spec", [k for k in registry.steps() if k.tunable], ids=lambda k: k.name)
def test_standalone_instantiations_are_the_registry_defaults(spec):
    """The instantiations a file compiles on its own (the nvcc check below and in CI) include
    every dtype's registry default, so that check builds what the loader builds."""
    text = (CUDA_DIR / spec.file).read_text()
    inst = set()
    for ctype, nums in re.findall(r"^DISTMM_INST\(([a-z ]+), ([0-9, ]+)\)$", text, re.M):
        vals = tuple(int(v) for v in nums.split(","))
        inst.add((ctype, vals if len(vals) == 9 else vals + (1,)))  # no MINB argument: 1
    keys = ("BM", "BN", "BK", "WM", "WN", "TM", "TN", "STAGES", "MINB")
    for dtype, ctype in registry.C_TYPES.items():
        p = spec.params(dtype)
        assert (ctype, tuple(p[k] for k in keys)) in inst, f"{spec.file}: no {dtype} default {p}"


def _nvcc(args, src=None):
    return subprocess.run([NVCC, *args], capture_output=True, text=True, input=src)


# The first source for both architectures in the default run; every other source (seconds
# of nvcc each) under ``pytest -m slow``, as in CI's own nvcc pass over every kernel.
NVCC_CASES = [pytest.param(file, arch, marks=() if file == CU_FILES[0] else pytest.mark.slow)
              for file in CU_FILES for arch in ("sm_90", "sm_80")]


@pytest.mark.slow  # nvcc builds (CI compiles every .cu file in its own step as well)
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("file,arch", NVCC_CASES)
def test_source_compiles_with_nvcc(file, arch, tmp_path):
    res = _nvcc(["-std=c++17", f"-arch={arch}", "-cubin", "-o", str(tmp_path / "k.cubin"),
                 str(CUDA_DIR / file)])
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.slow  # nvcc builds (CI compiles every .cu file in its own step as well)
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_split_tail_fixup_source_names_both_kernels(arch, tmp_path):
    """The split tail's fix-up is a .cu file of its own (compiled by the test above and in
    CI); the cubin holds the two names the loader asks for."""
    text = cuda_loader.source(cuda_loader.FIXUP_FILE)
    assert cuda_loader.FIXUP_FILE.startswith("10_") and "DISTMM_FIXUP" in text
    cubin = tmp_path / "f.cubin"
    res = _nvcc(["-std=c++17", f"-arch={arch}", "-cubin", "-o", str(cubin),
                 str(CUDA_DIR / cuda_loader.FIXUP_FILE)])
    assert res.returncode == 0, res.stderr[-3000:]
    for ctype in ("float", "double"):
        assert f"distmm_split_tail_fixup_{ctype}".encode() in cubin.read_bytes()


@pytest.mark.slow  # nvcc builds (CI compiles every .cu file in its own step as well)
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("spec", registry.steps(), ids=lambda k: k.name)
def test_loader_source_and_lowered_name(spec, tmp_path):
    """What the loader compiles (inlined headers, -DDISTMM_NVRTC, one explicit
    instantiation) builds, and the kernel's symbol is ``mangled_name`` of its expression."""
    p = spec.params("float64")
    if spec.tunable:  # a non-default shape of the tuning space
        p = dict(spec.params("float32"), BM=128, BN=256, WM=64, WN=64, TM=8, TN=16, STAGES=4)
        assert spec.violations("float32", p) == []
    dtype = "float32" if spec.tunable else "float64"
    expr = spec.name_expression(dtype, p, True, False)
    src = cuda_loader.source(spec.file) + cuda_loader.explicit_instantiation(
        expr, registry.C_TYPES[dtype])
    cu = tmp_path / "k.cu"
    cu.write_text(src)
    cubin = tmp_path / "k.cubin"
    res = _nvcc([*cuda_loader.OPTIONS, "-arch=sm_90", "-cubin", "-o", str(cubin), str(cu)])
    assert res.returncode == 0, res.stderr[-3000:]
    symbols = set(re.findall(rb"_Z\d+distmm_gemm_[A-Za-z0-9_]+", cubin.read_bytes()))
    assert symbols == {cuda_loader.mangled_name(expr).encode()}


def test_mangled_name_examples():
    m = cuda_loader.mangled_name
    assert m("distmm_gemm_naive<long long>") == "_Z17distmm_gemm_naiveIxEviiiT_PKS0_xS2_xS0_PS0_xi"
    assert m("distmm_gemm_vectorized<int,true,false>") == \
        "_Z22distmm_gemm_vectorizedIiLb1ELb0EEviiiT_PKS0_xS2_xS0_PS0_xi"
    with pytest.raises(ValueError):
        m("distmm_gemm_naive")


def test_simt_fp64_is_a_side_step():
    """Step 10 (SIMT float64) is registered, tested and benchmarked, but the raw backend's
    kernel stays step 9 (dmma) for every dtype. Its float64 default is the shape the H200
    search picked (bench/NOTES.md): 8 x 8 thread tiles in 128 threads, one block per SM's
    register budget (MINB = 1), four stages in step 8's shared-memory layout."""
    spec = registry.get("simt_fp64")
    assert not spec.raw_choice and registry.best_kernel() is registry.get("dmma")
    p = spec.params("float64")
    assert spec.threads(p) == 128 and p["MINB"] == 1 and p["TM"] * p["TN"] == 64
    assert p["STAGES"] == 4
    assert spec.violations("float64", dict(p, MINB=2))  # 64 accumulators need > 128 registers
    for ta in (False, True):
        for tb in (False, True):
            assert spec.smem_bytes("float64", p, ta, tb) == registry.get("warptile").smem_bytes(
                "float64", p, ta, tb)
    for dt in registry.DTYPES:
        assert spec.violations(dt, spec.params(dt)) == []
        cands = spec.candidates(dt)
        assert 1 < len(cands) <= 300 and cands[0] == spec.params(dt)
        assert {c["TM"] * c["TN"] for c in cands} >= {32, 64}  # 4x8 / 8x4 and 8x8 thread tiles


# -- tensor-core steps 11-15 (reduced precision) ----------------------------------------

TC = registry.tc_steps()
TC_INPUTS = [(spec, dt) for spec in TC for dt in spec.inputs]


def _tc_id(case):
    spec, dt = case
    return f"{spec.name}-{dt}"


def test_tensor_core_steps_leave_the_existing_table_alone():
    """Steps 11-15 live in their own table: steps(), best_kernel() and every dtype's
    "highest" kernel are what they were (dmma is still the raw backend's kernel)."""
    assert [k.name for k in TC] == ["mma_tf32", "mma_bf16", "wgmma_bf16", "wgmma_tma", "mma_tma"]
    assert not set(registry.TC_KERNELS) & set(registry.KERNELS)
    assert registry.best_kernel() is registry.get("dmma")
    assert [k.step for k in registry.steps()] == list(range(1, 11))
    for spec in TC:
        assert not spec.raw_choice
        with pytest.raises(KeyError):
            registry.get(spec.name)
        assert registry.get_tc(spec.name) is spec
    with pytest.raises(KeyError, match="known: mma_tf32"):
        registry.get_tc("nope")


@pytest.mark.parametrize("spec", TC, ids=lambda k: k.name)
def test_tc_template_names_a_kernel_in_its_file(spec):
    text = (CUDA_DIR / spec.file).read_text()
    entry = spec.template.split("<")[0]
    assert entry == f"distmm_gemm_{spec.name}"
    assert re.search(rf"__global__[^;{{]*\b{entry}\s*\(", text), f"{entry} not in {spec.file}"
    fields = set(re.findall(r"{(\w+)}", spec.template))
    for dt in spec.inputs:
        assert fields == {"T", "TA", "TB"} | set(spec.params(dt))
        assert registry.TC_INPUT_TYPES[dt] in spec.name_expression(dt, spec.params(dt), 0, 1)


@pytest.mark.parametrize("case", TC_INPUTS, ids=_tc_id)
def test_tc_defaults_are_valid_and_candidates_too(case):
    spec, dt = case
    p = spec.params(dt)
    assert spec.violations(dt, p, 90) == []
    for cc in (80, 86, 89):
        assert (spec.violations(dt, p, cc) == []) == spec.runs_on(cc)
    assert spec.threads(p) <= 1024
    cands = spec.candidates(dt, 90)
    assert cands[0] == p and len(cands) > 10
    assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)
    assert all(spec.violations(dt, c, 90) == [] for c in cands)
    # sm_80's smaller shared memory leaves fewer candidates, and only valid ones
    if spec.runs_on(80):
        c80 = spec.candidates(dt, 80)
        assert all(spec.violations(dt, c, 80) == [] for c in c80)


def test_tc_violations_catch_bad_configs():
    tf32, bf16, wg = (registry.get_tc(n) for n in ("mma_tf32", "mma_bf16", "wgmma_bf16"))
    p = tf32.params("float32")
    assert any("compute capability >= 80" in v for v in tf32.violations("float32", p, 75))
    assert any("no bfloat16" in v for v in tf32.violations("bfloat16", p))
    assert any("128-byte" in v for v in tf32.violations("float32", dict(p, BK=16)))
    assert any("warp tile" in v for v in tf32.violations("float32", dict(p, WM=24)))
    assert any("shared memory" in v for v in tf32.violations("float32", dict(p, STAGES=8)))
    q = bf16.params("bfloat16")
    # 16-bit rows: BK = 32 is 64 bytes, below the swizzle's 128
    assert any("128-byte" in v for v in bf16.violations("bfloat16", dict(q, BK=32)))
    assert any("multiples of 16" in v for v in bf16.violations("float16", dict(q, WN=8, BN=64)))
    # ldmatrix.x4 reads two n tiles' B fragments in step 11 too
    assert any("multiples of 16" in v for v in tf32.violations("float32", dict(p, WN=8)))
    assert any("LOOP=2" in v for v in tf32.violations("float32", dict(p, LOOP=2)))
    assert tf32.violations("float32", dict(p, LOOP=0)) == []
    assert any("no float32" in v for v in bf16.violations("float32", q))
    w = wg.params("bfloat16")
    for cc in (80, 89, 100):
        assert any("compute capability 90" in v for v in wg.violations("bfloat16", w, cc))
    assert any("wgmma's N" in v for v in wg.violations("bfloat16", dict(w, BN=96)))
    assert any("warpgroup" in v for v in wg.violations("bfloat16", dict(w, BM=96)))
    assert any("registers" in v for v in wg.violations("bfloat16", dict(w, BN=256)))
    assert wg.violations("bfloat16", dict(w, BM=64, BN=256)) == []
    assert any("INFLIGHT=2" in v for v in wg.violations("bfloat16", dict(w, INFLIGHT=2)))
    # the tuner tries each configuration with and without a wgmma group left in flight; a
    # configuration saved before INFLIGHT existed reads back with its default
    cands = wg.candidates("bfloat16", 90)
    assert {c["INFLIGHT"] for c in cands} == {0, 1}
    assert wg.params("bfloat16", {"BM": 64, "BN": 128, "BK": 64, "STAGES": 5}) == {
        "BM": 64, "BN": 128, "BK": 64, "STAGES": 5, "INFLIGHT": 0}


def test_tma_step_constraints():
    """Step 14: a k tile is one 128-byte swizzle row, one or two consumer warpgroups (the
    second takes the producer's registers: 128 accumulators fit), 1024 bytes of alignment."""
    tma = registry.get_tc("wgmma_tma")
    p = tma.params("bfloat16")
    assert p == {"BM": 128, "BN": 256, "BK": 64, "STAGES": 4}
    assert any("swizzle row" in v for v in tma.violations("bfloat16", dict(p, BK=32)))
    assert any("consumer" in v for v in tma.violations("bfloat16", dict(p, BM=192, BN=128)))
    assert tma.violations("float16", dict(p, BM=64)) == []
    assert tma.smem_bytes("bfloat16", p) == 1024 + 4 * (128 + 256) * 64 * 2 + 4 * 16
    assert tma.threads(p) == 384 and tma.tma and not registry.get_tc("wgmma_bf16").tma
    assert "distmm_tmap" in cuda_loader.tc_instantiation("x<1>", "distmm_bf16", tma=True)


def test_mma_tma_step_constraints():
    """Step 15: step 12's warps and tiles, a k tile of one 128-byte swizzle row (BK 64 only),
    1024 bytes of alignment, a full and an empty mbarrier a stage, stages handed back by a
    block barrier, by the empty mbarriers, or to a producer warpgroup (SYNC 0, 1, 2; built
    for sm_90a, whose setmaxnreg gives the producer's registers to the computing warps);
    k = 0 goes to step 12."""
    spec = registry.get_tc("mma_tma")
    p = spec.params("bfloat16")
    assert spec.tma and not spec.wgmma and spec.step == 15 and spec.arch_suffix == "a"
    assert spec.threads(p) == 128  # four 64 x 64 warp tiles
    assert any("swizzle row" in v for v in spec.violations("bfloat16", dict(p, BK=128)))
    assert spec.violations("float16", p) == []
    assert p == dict(registry.get_tc("mma_bf16").params("bfloat16"), SYNC=0)
    assert spec.smem_bytes("bfloat16", p) == 1024 + 3 * (128 + 128) * 64 * 2 + 3 * 16
    assert any("SYNC=3" in v for v in spec.violations("bfloat16", dict(p, SYNC=3)))
    # a producer warpgroup: 128 threads more; two blocks an SM leave each thread 128
    # registers at launch, room for 40 (producer) and 216 (computing warps); one block 248
    ws = dict(p, SYNC=2, MINB=2)
    assert spec.threads(ws) == 256 and spec.violations("bfloat16", ws) == []
    assert any("registers a thread" in v for v in spec.violations("bfloat16", dict(ws, MINB=1)))
    assert any("warpgroups" in v for v in spec.violations("bfloat16", dict(ws, BN=64)))
    assert spec.violations("bfloat16", dict(ws, BN=256, MINB=1, STAGES=4)) == []  # 384 threads
    assert any("SYNC=2" in v for v in registry.get_tc("mma_bf16").violations("bfloat16", dict(ws)))
    assert {c["SYNC"] for c in spec.candidates("bfloat16")} == {0, 1, 2}
    assert {c["BK"] for c in spec.candidates("bfloat16")} == {64}
    assert {c["BK"] for c in spec.candidates("float32")} == {32}  # TF32: 32 values a row
    assert spec.layouts("float32") == [(False, True)] and len(spec.layouts("bfloat16")) == 4
    assert not registry.get_tc("mma_tf32").kmajor_only("float32")
    assert spec.violations("float32", spec.params("float32")) == []
    assert not spec.runs_on(80) and spec.runs_on(90)
    assert cuda_loader.TMA_K_ZERO["mma_tma"] == {"bf16": "mma_bf16", "fp16": "mma_bf16",
                                                 "tf32": "mma_tf32"}
    assert cuda_loader.TMA_K_ZERO["wgmma_tma"] == {"bf16": "wgmma_bf16", "fp16": "wgmma_bf16",
                                                   "tf32": "mma_tf32"}


def test_tensor_map_eligibility_and_boxes():
    from distmm.executor import tma

    assert tma.eligible(1 << 20, 1000, 64, 64)
    assert not tma.eligible(1 << 20, 1000, 63, 63)  # rows of 126 bytes
    assert tma.eligible(1 << 20, 1000, 63, 64)  # padded rows
    assert not tma.eligible((1 << 20) + 2, 1000, 64, 64)  # base off 16 bytes
    assert not tma.eligible(1 << 20, 0, 64, 64) and not tma.eligible(1 << 20, 8, 0, 8)
    assert tma.box_for(True, 128) == (64, 128) and tma.box_for(False, 256) == (64, 64)
    assert tma.box_for(True, 256, 4) == (32, 256)  # TF32: a 128-byte row is 32 values
    assert tma.eligible(1 << 20, 1000, 36, 36, 4) and not tma.eligible(1 << 20, 1000, 30, 30, 4)
    with pytest.raises(ValueError, match="16-byte"):
        tma.encode_2d(3, 8, 8, 8, (64, 8))
    with pytest.raises(ValueError, match="2- or 4-byte"):
        tma.encode_2d(1 << 20, 8, 8, 8, (16, 8), 8)
    if tma._lib() is None:  # no driver here (CI): one clear error, before any launch
        with pytest.raises(RuntimeError, match="libcuda"):
            tma.encode_2d(1 << 20, 8, 64, 64, (64, 8))
        with pytest.raises(RuntimeError, match="libcuda"):
            tma.launch(1, (1, 1, 1), (128, 1, 1), 0, 0, ())


def test_tc_shared_memory_and_geometry():
    tf32, bf16, wg = (registry.get_tc(n) for n in ("mma_tf32", "mma_bf16", "wgmma_bf16"))
    p = {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 32, "STAGES": 3, "MINB": 1}
    assert tf32.smem_bytes("float32", p) == 3 * (128 * 32 + 32 * 128) * 4  # Tf32Shape
    q = dict(p, BK=64)
    assert bf16.smem_bytes("bfloat16", q) == 3 * (128 * 64 + 64 * 128) * 2  # Mma16Shape
    w = {"BM": 128, "BN": 128, "BK": 64, "STAGES": 4}
    assert wg.smem_bytes("float16", w) == 4 * (128 + 128) * 64 * 2 + 4 * 16  # + mbarriers
    assert tf32.threads(p) == 256 and wg.threads(w) == 384  # producer + 2 consumer warpgroups
    assert wg.grid_dims(1000, 129, w) == (8 * 2, 1, 1)
    assert tf32.grid_dims(1, 1, p) == (1, 1, 1)


@pytest.mark.parametrize("dtype,precision,cc,expected", [
    ("float32", "tf32", 90, "wgmma_tma"), ("float32", "tf32", 80, "mma_tf32"),
    ("float32", "tf32", 75, None), ("float32", "bf16", 90, "wgmma_tma"),
    ("float32", "bf16", 89, "mma_bf16"), ("float32", "bf16", 80, "mma_bf16"),
    ("float32", "bf16", 100, "mma_bf16"), ("bfloat16", "bf16", 90, "wgmma_tma"),
    ("float16", "fp16", 86, "mma_bf16"), ("float32", "fp16", 90, "wgmma_tma"),
    ("float16", "bf16", 90, None), ("float64", "tf32", 90, None), ("int32", "bf16", 90, None),
    ("float32", "highest", 90, None), ("float64", "highest", 90, None),
])
def test_kernel_for(dtype, precision, cc, expected):
    spec = registry.kernel_for(dtype, precision, cc)
    assert (spec.name if spec else None) == expected
    if spec is not None:
        fmt = spec.precisions[precision]
        assert fmt == registry.PRECISION_INPUT[precision]
        assert spec.violations(fmt, spec.params(fmt), cc) == []


@pytest.mark.parametrize("spec", TC, ids=lambda k: k.name)
def test_tc_standalone_instantiations_are_the_registry_defaults(spec):
    text = (CUDA_DIR / spec.file).read_text()
    # DISTMM_INST(every layout) or DISTMM_INST2(one layout: TF32 wgmma's k-major operands)
    inst = {(m.group(1) or "float", tuple(int(v) for v in m.group(2).split(",")))
            for m in re.finditer(r"^DISTMM_INST2?\((?:(distmm_\w+|float), )?([0-9, ]+)"
                                 r"(?:, (?:true|false), (?:true|false))?\)$", text, re.M)}
    for dt in spec.inputs:
        p = spec.params(dt)
        assert (registry.TC_INPUT_TYPES[dt], tuple(p.values())) in inst, f"no {dt} default {p}"


def test_tc_mangled_names():
    m = cuda_loader.mangled_name
    assert m("distmm_gemm_mma_bf16<distmm_fp16,64,64,64,32,32,2,1,true,false>") == (
        "_Z20distmm_gemm_mma_bf16I11distmm_fp16Li64ELi64ELi64ELi32ELi32ELi2ELi1ELb1ELb0EE"
        "viiifPKT_xS3_xfPfxi")


@pytest.mark.slow  # nvcc builds (CI compiles every .cu file in its own step as well)
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("case", TC_INPUTS, ids=_tc_id)
def test_tc_loader_source_and_lowered_name(case, tmp_path):
    """What the loader compiles for a tensor-core kernel (inlined headers, -DDISTMM_NVRTC,
    one instantiation, a non-default candidate) builds for its target (sm_90a for wgmma),
    and its one symbol is ``mangled_name`` of the expression."""
    spec, dt = case
    p = spec.candidates(dt)[3]
    # A stored K x M, B K x N where the input takes it; TF32 on the TMA steps: k-major only
    ta, tb = (True, False) if (True, False) in spec.layouts(dt) else spec.layouts(dt)[0]
    expr = spec.name_expression(dt, p, ta, tb)
    src = cuda_loader.source(spec.file) + cuda_loader.tc_instantiation(
        expr, registry.TC_INPUT_TYPES[dt], spec.tma)
    cu = tmp_path / "k.cu"
    cu.write_text(src)
    cubin = tmp_path / "k.cubin"
    res = _nvcc([*cuda_loader.OPTIONS, f"-arch=sm_90{spec.arch_suffix}", "-cubin", "-o", str(cubin),
                 str(cu)])
    assert res.returncode == 0, res.stderr[-3000:]
    symbols = set(re.findall(rb"_Z\d+distmm_gemm_[A-Za-z0-9_]+", cubin.read_bytes()))
    if spec.tma:  # tensor maps in the signature: the loader finds the cubin's one symbol
        stem = f"_Z{len('distmm_gemm_' + spec.name)}distmm_gemm_{spec.name}I".encode()
        assert len(symbols) == 1 and next(iter(symbols)).startswith(stem)
    else:
        assert symbols == {cuda_loader.mangled_name(expr).encode()}


@pytest.mark.slow  # nvcc builds (CI compiles every .cu file in its own step as well)
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch,has_wgmma", [("sm_90a", True), ("sm_90", False), ("sm_80", False)])
@pytest.mark.parametrize("file,n,copy", [("13_wgmma_bf16.cu", 128, "cp.async.mbarrier.arrive"),
                                         ("14_wgmma_tma.cu", 256, "cp.async.bulk.tensor.2d")])
def test_wgmma_body_only_for_sm90a(file, n, copy, arch, has_wgmma, tmp_path):
    """Steps 13 and 14 are wgmma only where nvcc targets sm_90a; CI's -arch=sm_90 and sm_80
    builds compile a trapping stub (the registry never launches those). Step 13 copies with
    cp.async, step 14 with the copy engine (and moves registers with setmaxnreg)."""
    ptx = tmp_path / "k.ptx"
    res = _nvcc(["-std=c++17", f"-arch={arch}", "-ptx", "-o", str(ptx), str(CUDA_DIR / file)])
    assert res.returncode == 0, res.stderr[-3000:]
    text = ptx.read_text()
    assert (f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16" in text) == has_wgmma
    assert ("mbarrier.try_wait.parity" in text) == has_wgmma
    assert (copy in text) == has_wgmma
    assert ("setmaxnreg.inc" in text) == (has_wgmma and file.startswith("14"))
    assert ("trap;" in text) == (not has_wgmma)


@pytest.mark.slow  # nvcc builds
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("arch,has_tma", [("sm_90a", True), ("sm_90", True), ("sm_80", False)])
def test_mma_tma_body_from_sm90(arch, has_tma, tmp_path):
    """Step 15 needs the copy engine and mbarrier waits, which compute capability 9.0 has
    without sm_90a: a body of mma.sync fed by cp.async.bulk.tensor on sm_90 and sm_90a, a
    trapping stub on sm_80 (where the registry never launches it), and no cp.async of
    16-byte chunks or wgmma anywhere."""
    ptx = tmp_path / "k.ptx"
    res = _nvcc(["-std=c++17", f"-arch={arch}", "-ptx", "-o", str(ptx),
                 str(CUDA_DIR / "15_mma_tma.cu")])
    assert res.returncode == 0, res.stderr[-3000:]
    text = ptx.read_text()
    assert ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text) == has_tma
    assert ("cp.async.bulk.tensor.2d" in text) == has_tma
    assert ("mbarrier.try_wait.parity" in text) == has_tma
    assert ("ldmatrix.sync.aligned.m8n8.x4.trans" in text) == has_tma
    assert ("trap;" in text) == (not has_tma)
    assert "cp.async.cg" not in text and "cp.async.ca" not in text and "wgmma" not in text


def test_launch_reads_a_tensor_core_precision_off_the_operands():
    """``cuda_loader.launch`` hands a tensor-core step to ``launch_tc`` with the precision its
    operands' dtype names; float32 operands of a 16-bit step are refused (they need
    ``launch_tc(precision=...)``, which converts them)."""
    pick = cuda_loader._precision_of
    assert pick("mma_tf32", np.float32) == "tf32"
    assert pick("mma_bf16", np.uint16) == "bf16" and pick("wgmma_bf16", np.float16) == "fp16"
    with pytest.raises(TypeError, match="launch_tc"):
        pick("mma_bf16", np.float32)
    with pytest.raises(TypeError, match="not float16"):
        pick("mma_tf32", np.float16)


_BEST = registry.best_kernel()


def _changed(dtype, **change):
    """The registry's defaults of the raw backend's kernel with ``change`` (None: dropped)."""
    p = dict(_BEST.params(dtype), **change)
    return {k: v for k, v in p.items() if v is not None}


@pytest.mark.parametrize("params, why", [
    (_changed("float32", TM=0), "TM=0, TN=8: outside"),      # was a ZeroDivisionError
    (_changed("float32", BK=-16), "BK=-16: outside"),        # was compiled with BK=-16
    (_changed("float32", BK=24), "BK=24: outside"),          # static_asserts the space keeps
    (_changed("float32", BK=16.0), "BK=16.0 is not an integer"),  # was truncated silently
    (_changed("float32", BK="16"), "BK='16' is not an integer"),
    (_changed("float32", STAGES=True), "STAGES=True is not an integer"),
    (_changed("float32", MINB=None), "no MINB"),              # a parameter added since
    (_changed("float32", SPLIT=1), "SPLIT: not a parameter"),  # one removed since
    (_changed("float32", BM=64, BN=64, WM=32, WN=128, TM=8, TN=16), "not a multiple"),
    ([128, 128], "a list, not an object of parameters"),
])
def test_a_tuned_configuration_that_does_not_fit_gives_the_defaults(params, why):
    """``kernel_params`` takes tuned parameters only where ``config_problem`` finds nothing
    wrong: a hand-edited or older cache never reaches the compiler or a launch."""
    assert registry.kernel_params(_BEST, "float32", params) == _BEST.params("float32")
    assert why in registry.config_problem(_BEST, "float32", params, 90)


def test_every_candidate_is_a_configuration_a_cache_may_hold():
    for spec in (_BEST, registry.get_tc("mma_tma")):
        for dt in spec.defaults:
            cands = spec.candidates(dt, 90)
            assert all(registry.config_problem(spec, dt, c, 90) is None for c in cands)
            assert registry.kernel_params(spec, dt, cands[-1], 90) == cands[-1]
    # one of sm_90's that needs more shared memory than sm_80 has: the defaults there
    sm80 = _BEST.candidates("float64", 80)
    big = next(c for c in _BEST.candidates("float64", 90) if c not in sm80)
    assert "shared memory" in registry.config_problem(_BEST, "float64", big, 80)
    assert registry.kernel_params(_BEST, "float64", big, 80) == _BEST.params("float64")
    tma = registry.get_tc("mma_tma")  # a k tile of TF32 is one 128-byte row: BK=32 only
    assert "BK=64" in registry.config_problem(tma, "float32", dict(tma.params("float32"), BK=64))


def test_a_cache_entry_that_does_not_fit_is_ignored_with_one_warning(tmp_path, monkeypatch,
                                                                       caplog):
    """What the GPU executor takes from the cache (``usable_entry``): an entry of this
    distmm's kernel that ``distmm tune`` could have stored, else nothing (the defaults, and
    cuBLAS where ``auto`` would have followed its ``prefer``) with one warning naming the
    file, the entry and what is wrong."""
    import json
    import logging

    monkeypatch.setenv("DISTMM_CACHE_DIR", str(tmp_path))
    good = {"kernel": _BEST.name, "params": _BEST.candidates("float32")[-1],
            "prefer": {"large": "raw", "small": "cublas"}, "tflops": 40.0}
    entries = {
        "float32": good,
        "float64": dict(good, kernel="warptile2"),  # a kernel renamed since
        "int32": dict(good, params=_changed("int32", WM="32")),
        "int64": dict(good, params=_BEST.params("int64"), prefer={"large": "fast"}),
    }
    path = tmp_path / "tune.json"
    path.write_text(json.dumps({"version": 1, "gpus": {"GPU Y": entries}}))
    read = tuning.tuning_for("GPU Y")
    with caplog.at_level(logging.WARNING, logger="distmm.executor.tuning"):
        assert tuning.usable_entry(read, "float32", _BEST, 90, gpu="GPU Y") == good
        for dt, why in (("float64", "kernel 'warptile2', not this distmm's 'dmma'"),
                        ("int32", "params: WM='32' is not an integer"),
                        ("int64", "prefer: 'large': 'fast'")):
            assert tuning.usable_entry(read, dt, _BEST, 90, gpu="GPU Y") == {}
            (said,) = [r.getMessage() for r in caplog.records if f" {dt} entry" in r.getMessage()]
            assert said.startswith(f"{path}: ignoring the {dt} entry of GPU Y ({why}")
            defaults = ", ".join(f"{k}={v}" for k, v in _BEST.params(dt).items())
            assert f"using dmma's defaults ({defaults})" in said
        assert tuning.usable_entry(read, "float64", _BEST, 90, gpu="GPU Y") == {}
        assert tuning.usable_entry({"float64": [1]}, "float64", _BEST, 90, gpu="GPU Z") == {}
    said = [r.getMessage() for r in caplog.records if r.name == "distmm.executor.tuning"]
    assert len(said) == 4  # once each: the second look at float64 says nothing
    assert "a list, not an object" in said[-1]
    assert tuning.usable_entry(read, "float16", _BEST, 90, gpu="GPU Y") == {}  # none: no word
    assert len([r for r in caplog.records if r.name == "distmm.executor.tuning"]) == 4


@pytest.mark.gpu
def test_the_gpu_executor_takes_only_a_cache_entry_that_fits(tmp_path, monkeypatch, caplog):
    """On a GPU: a valid entry's parameters and ``prefer`` are used (and are the kernel facts
    a ``--resume`` manifest keeps); an entry that does not fit gives the defaults and cuBLAS
    for ``auto``, with one warning, and its products run."""
    import json
    import logging

    import cupy

    from distmm.executor.device import gpu_name
    from distmm.executor.gpu import GPUExecutor

    monkeypatch.setenv("DISTMM_CACHE_DIR", str(tmp_path))
    cc = int(cupy.cuda.Device().compute_capability)
    tuned = _BEST.candidates("float32", cc)[-1]
    raw_everywhere = {c: "raw" for c in ("small", "medium", "large", "skinny")}
    entries = {"float32": {"kernel": _BEST.name, "params": tuned, "prefer": raw_everywhere},
               "float64": {"kernel": _BEST.name, "params": _changed("float64", TM=0),
                           "prefer": raw_everywhere}}
    (tmp_path / "tune.json").write_text(json.dumps({"version": 1, "gpus": {gpu_name(): entries}}))
    with caplog.at_level(logging.WARNING, logger="distmm.executor.tuning"):
        auto, raw = GPUExecutor(backend="auto"), GPUExecutor(backend="raw")
        assert raw.kernel_params("float64") == _BEST.params("float64")  # TM=0: the defaults
        assert auto.choose("float64", 4096, 4096, 4096) == "cublas"
        assert auto.kernel_params("float32") == tuned == raw.kernel_params("float32")
        assert auto.choose("float32", 4096, 4096, 4096) == "raw"
        assert auto.kernel_facts("float32") == {"prefer": raw_everywhere,
                                                "raw": {"kernel": _BEST.name, "params": tuned}}
        assert raw.kernel_facts("float32") == {"raw": {"kernel": _BEST.name, "params": tuned}}
        assert GPUExecutor(backend="cublas").kernel_facts("float32") == {}
        assert raw.kernel_facts("int64") == {}  # exact sums: any kernel gives the same bits
        assert auto.kernel_facts("float64") == {}
        rng = np.random.default_rng(5)
        a, b = (cupy.asarray(rng.standard_normal(s)) for s in ((300, 200), (200, 100)))
        c = cupy.empty((300, 100))
        raw.device_gemm(a, b, c)
        np.testing.assert_allclose(cupy.asnumpy(c), cupy.asnumpy(a) @ cupy.asnumpy(b),
                                   rtol=1e-12, atol=1e-12)
    (said,) = [r.getMessage() for r in caplog.records if r.name == "distmm.executor.tuning"]
    assert f"ignoring the float64 entry of {gpu_name()}" in said and "TM=0" in said, said
    tf32 = GPUExecutor(backend="raw", precision="tf32")
    spec = registry.kernel_for("float32", "tf32", cc)
    assert tf32.kernel_facts("float32") == {"raw": {"kernel": spec.name,
                                                    "params": spec.params("float32")}}
