"""Compile, cache and launch distmm's CUDA GEMM kernels through CuPy.

This module covers: turning a registry entry (``distmm.executor.registry``) plus a dtype, template
parameters and transpose flags into a loaded kernel, with ``cupy.RawModule(code=...,
options=...)`` and NVRTC (the instantiation written out explicitly and looked up by its
lowered name, so that CuPy caches the binary on disk under ``CUPY_CACHE_DIR``, default
``~/.cupy/kernel_cache``; ``name_expressions=[...]`` is the fallback and the check) or, where NVRTC cannot be used
(``DISTMM_CUDA_COMPILER=nvcc``), ``nvcc -cubin`` into distmm's cache directory, loaded by path;
computing the launch geometry; checking every launch; and compiling many kernels ahead of
time in parallel (``warm``). cupy is imported where a kernel is loaded, so the sources
and the registry can be checked on machines without it.

It does *not* cover: which kernel or backend to use (``distmm.executor.gpu``), or tuning
(``distmm.cli.tune``).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

import distmm.executor.registry as registry
from distmm.executor import tma, tuning

__all__ = ["source", "get_kernel", "mangled_name", "launch", "warm", "cache_dir", "compute_capability",
           "KernelLaunchError", "OPTIONS", "FIXUP_FILE", "split_tail_plan", "grouped_tile_origins",
           "explicit_instantiation", "tc_instantiation", "get_tc_kernel", "launch_tc",
           "to_input_format", "MAX_DIM"]

log = logging.getLogger("distmm.executor.cuda_loader")

OPTIONS = ("-std=c++17", "-DDISTMM_NVRTC")
# a local include, a comment allowed after it on the line
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*(?://.*)?$', re.M)


class KernelLaunchError(RuntimeError):
    """A kernel could not be launched, or failed while running (checked launches)."""


def cuda_dir() -> Path:
    from distmm.kernels import CUDA_DIR

    return Path(CUDA_DIR)


def cache_dir() -> Path:
    """distmm's cache folder (see ``distmm.executor.tuning.cache_dir``)."""
    return tuning.cache_dir()


@functools.lru_cache(maxsize=None)
def source(file: str) -> str:
    """The kernel file's text with its local ``#include "x.cuh"`` lines inlined (once each),
    so NVRTC needs no include path and CuPy's cache key covers the headers too."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (cuda_dir() / name).read_text()
        text = text.replace("#pragma once", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(file)


def compute_capability() -> int:
    import cupy

    dev = cupy.cuda.Device()
    return int(dev.compute_capability)


def explicit_instantiation(expr: str, ctype: str) -> str:
    """The line that instantiates kernel template ``expr`` for element type ``ctype``, put
    after a kernel's source when nvcc compiles it (``source(file) + "\n" + this``)."""
    return (f"template __global__ void {expr}(int, int, int, {ctype}, const {ctype}*, long long, "
            f"const {ctype}*, long long, {ctype}, {ctype}*, long long, int);\n")


def _defines_text(defines: tuple) -> str:
    """``#define`` lines put before a kernel's source (compile-time variants, see ``get_kernel``)."""
    return "".join(f"#define {k} {int(v)}\n" for k, v in defines)


def _compile_nvcc(spec, expr: str, ctype: str, defines: tuple = (), inst: str | None = None,
                  arch_suffix: str = ""):
    """Compile one instantiation with nvcc to a cubin in the cache folder; load it by path.
    (``inst``: the instantiation line, default ``explicit_instantiation(expr, ctype)``;
    ``arch_suffix``: ``"a"`` for the architecture-specific target, sm_90a.)"""
    import cupy

    cc = f"{compute_capability()}{arch_suffix}"
    text = (_defines_text(defines) + source(spec.file) + "\n"
            + (inst or explicit_instantiation(expr, ctype)))
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    key = hashlib.sha256(f"{cc}\n{text}\n{OPTIONS}".encode()).hexdigest()[:24]
    folder = cache_dir() / "cubin"
    folder.mkdir(parents=True, exist_ok=True)
    cubin = folder / f"{spec.name}-{key}.cubin"
    if not cubin.exists():
        cu = folder / f"{spec.name}-{key}.cu"
        cu.write_text(text)
        tmp = cubin.with_suffix(f".{os.getpid()}.tmp")
        cmd = [nvcc, *OPTIONS, f"-arch=sm_{cc}", "-cubin", "-o", str(tmp), str(cu)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise KernelLaunchError(f"nvcc failed for {expr}:\n{res.stderr[-4000:]}")
        os.replace(tmp, cubin)
    data = cubin.read_bytes()
    # The cubin's symbol table names the one kernel it holds (the .text.<name> and
    # .nv.info.<name> sections repeat the mangled name).
    kernels = sorted({n.decode() for n in re.findall(rb"_Z\d+distmm_gemm_[A-Za-z0-9_]+", data)})
    if len(kernels) != 1:
        raise KernelLaunchError(f"expected one kernel in {cubin}, found {kernels}")
    module = cupy.RawModule(path=str(cubin))
    return module.get_function(kernels[0])


_TYPE_CODES = {"float": "f", "double": "d", "int": "i", "long long": "x",
               "distmm_bf16": "11distmm_bf16", "distmm_fp16": "11distmm_fp16"}
_PARAMS_MANGLED = "viiiT_PKS0_xS2_xS0_PS0_xi"  # (int, int, int, T, const T*, long long, ...)
# the tensor-core steps' 16-bit inputs: (int, int, int, float, const Tin*, long long, ...,
# float, float*, long long, int), Tin a class type (itself a substitution candidate)
_PARAMS_MANGLED_16 = "viiifPKT_xS3_xfPfxi"


def mangled_name(expr: str) -> str:
    """The Itanium-ABI name of ``distmm_gemm_<step><T, ints..., bools...>`` with distmm's one
    kernel signature, e.g. ``_Z17distmm_gemm_naiveIfEviiiT_PKS0_xS2_xS0_PS0_xi``.

    Checked against nvcc's symbols for every registered kernel in the CPU tests and against
    NVRTC's lowered name on the device.
    """
    m = re.fullmatch(r"(\w+)<(.*)>", expr.replace(" ", "").replace("longlong", "long long"))
    if not m:
        raise ValueError(f"not a template name expression: {expr!r}")
    name, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
    codes = []
    for a in args:
        if a in _TYPE_CODES:
            codes.append(_TYPE_CODES[a])
        elif a in ("true", "false"):
            codes.append(f"Lb{int(a == 'true')}E")
        elif re.fullmatch(r"-?\d+", a):
            codes.append(f"Li{'n' + a[1:] if a.startswith('-') else a}E")
        else:
            raise ValueError(f"cannot mangle template argument {a!r} of {expr!r}")
    sig = _PARAMS_MANGLED_16 if args[0] in ("distmm_bf16", "distmm_fp16") else _PARAMS_MANGLED
    return f"_Z{len(name)}{name}I{''.join(codes)}E{sig}"


@functools.lru_cache(maxsize=None)
def _kernel(name: str, dtype: str, params_key: tuple, ta: bool, tb: bool, compiler: str,
            defines: tuple = ()):
    import cupy

    spec = registry.get(name)
    params = dict(params_key)
    expr = spec.name_expression(dtype, params, ta, tb)
    ctype = registry.C_TYPES[dtype]
    if compiler == "nvcc":
        return _compile_nvcc(spec, expr, ctype, defines)
    if os.environ.get("DISTMM_NAME_EXPRESSIONS", "0") not in ("", "0"):
        return _kernel_by_name_expression(spec, expr, defines)
    # CuPy's disk cache skips modules compiled with name_expressions (it recompiles them
    # to learn the lowered names), so every process would compile every kernel again. The
    # instantiation is therefore written out explicitly and its lowered name derived
    # (``mangled_name``); the module is then cached on disk like any RawModule.
    code = _defines_text(defines) + source(spec.file) + "\n" + explicit_instantiation(expr, ctype)
    module = cupy.RawModule(code=code, options=OPTIONS)
    kern = module.get_function(mangled_name(expr))
    try:
        kern.kernel  # noqa: B018 - compile or load now, so a wrong name falls back here
    except cupy.cuda.driver.CUDADriverError:
        log.warning("lowered name of %s not found; compiling with name_expressions", expr)
        return _kernel_by_name_expression(spec, expr, defines)
    return kern


def _kernel_by_name_expression(spec, expr: str, defines: tuple = ()):
    """``RawModule(code=..., options=..., name_expressions=[expr])``: NVRTC names the
    instantiation (compiled in every process: CuPy does not cache these on disk)."""
    import cupy

    code = _defines_text(defines) + source(spec.file) + f"\n// distmm instantiation: {expr}\n"
    module = cupy.RawModule(code=code, options=OPTIONS, name_expressions=[expr])
    return module.get_function(expr)


def get_kernel(name: str, dtype, params: Mapping[str, int] | None = None, ta: bool = False,
               tb: bool = False, compiler: str | None = None,
               defines: Mapping[str, int] | None = None):
    """The loaded kernel (a ``cupy.RawKernel``) of one instantiation, compiled on first use.

    Parameters
    ----------
    name : str
        Registry name (``"warptile"``).
    dtype : dtype
        float32, float64, int32 or int64.
    params : mapping, optional
        Template parameters of tunable kernels; default: the registry's.
    ta, tb : bool
        Transpose flags (template parameters of the kernels that take them as such).
    compiler : {"nvrtc", "nvcc"}, optional
        Default: ``$DISTMM_CUDA_COMPILER`` or ``"nvrtc"``.
    defines : mapping, optional
        Compile-time variants of the source (``#define NAME int`` before it), for A/B
        benchmarks of a kernel's inner loop (``bench/simt64_variants.py``); the registry's
        kernels are the sources' defaults.
    """
    spec = registry.get(name)
    dtype = np.dtype(dtype).name
    if dtype not in spec.dtypes:
        raise TypeError(f"kernel {name} has no {dtype} instantiation (has {spec.dtypes})")
    p = spec.params(dtype, params)
    if not spec.layout_template:
        ta = tb = False
    compiler = compiler or os.environ.get("DISTMM_CUDA_COMPILER", "nvrtc")
    if compiler not in ("nvrtc", "nvcc"):
        raise ValueError(f"compiler must be 'nvrtc' or 'nvcc', got {compiler!r}")
    dkey = tuple(sorted((str(k), int(v)) for k, v in (defines or {}).items()))
    for k, _ in dkey:
        if not re.fullmatch(r"DISTMM_[A-Z0-9_]+", k):
            raise ValueError(f"define names must be DISTMM_ macros, got {k!r}")
    return _kernel(name, dtype, tuple(sorted(p.items())), bool(ta), bool(tb), compiler, dkey)


#: kernels whose dynamic shared-memory limit was raised, by (id, bytes). The value keeps the
#: kernel object alive: keyed by id() alone, a kernel collected after ``_kernel.cache_clear()``
#: could hand its id to a new kernel that was never raised (and its launch would fail).
_smem_set: dict = {}


def _operand_flags(x, ld: int) -> bool:
    """Whether 16-byte vector loads are safe: aligned base, ld a multiple of 16 bytes."""
    return x.data.ptr % 16 == 0 and (ld * x.itemsize) % 16 == 0


def grouped_tile_origins(m: int, n: int, bm: int, bn: int, bids) -> tuple[np.ndarray, np.ndarray]:
    """(m0, n0) of the C tiles with indices ``bids`` in the grouped order of steps 8-10
    (``grouped_tile_origin`` in pipelined.cuh, which this mirrors)."""
    group = 8
    bids = np.asarray(bids, dtype=np.int64)
    grid_m, grid_n = -(-m // bm), -(-n // bn)
    width = group * grid_n
    first_m = (bids // width) * group
    gsize = np.minimum(grid_m - first_m, group)
    m0 = (first_m + (bids % width) % gsize) * bm
    n0 = ((bids % width) // gsize) * bn
    return m0, n0


def split_tail_plan(tiles: int, slots: int, k_tiles: int, min_k_tiles: int = 4) -> tuple[int, int]:
    """``(r, s)``: split the last ``r`` tiles of a launch into ``s`` ranges of k tiles each,
    or ``(0, 1)`` for no split.

    ``slots`` blocks run at once (blocks per SM x SMs), so ``tiles`` tiles take
    ``ceil(tiles / slots)`` waves and the last holds ``r = tiles % slots`` of them (all of
    them when ``tiles < slots``), leaving ``slots - r`` slots idle for a whole tile's time.
    Split ``s = slots // r`` ways along k (each range at least ``min_k_tiles`` k tiles), the
    last wave takes about ``1/s`` of that. No split when ``s < 2``.
    """
    if tiles <= 0 or slots <= 0:
        return 0, 1
    r = tiles % slots
    if r == 0:
        return 0, 1
    s = min(slots // r, k_tiles // max(min_k_tiles, 1), 64)
    return (r, s) if s >= 2 else (0, 1)


#: the split tail's fix-up kernels (one per element type), a source of their own
FIXUP_FILE = "10_split_tail_fixup.cu"

@functools.lru_cache(maxsize=None)
def _fixup_kernel(ctype: str):
    """The fix-up for ``float`` or ``double`` (plain C names: CuPy caches the module on disk)."""
    import cupy

    return cupy.RawModule(code=source(FIXUP_FILE), options=("-std=c++17",)).get_function(
        f"distmm_split_tail_fixup_{ctype}")


@functools.lru_cache(maxsize=256)
def _tail_origins(device: int, m: int, n: int, bm: int, bn: int, r: int):
    import cupy

    tiles = -(-m // bm) * -(-n // bn)
    m0, n0 = grouped_tile_origins(m, n, bm, bn, np.arange(tiles - r, tiles))
    out = cupy.asarray(m0), cupy.asarray(n0)
    # cached and later used from any stream: the copies must be complete, not only queued
    cupy.cuda.get_current_stream().synchronize()
    return out


def _slots(kern, threads: int, smem: int) -> int:
    """Blocks of ``kern`` that run at once on this GPU (occupancy x SMs)."""
    import cupy

    return _slots_on(kern, threads, smem, cupy.cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _slots_on(kern, threads: int, smem: int, device: int) -> int:
    """``_slots`` for one device, asked once per kernel and launch shape (not per launch)."""
    import cupy

    dev = cupy.cuda.Device(device)
    try:
        per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kern.kernel.ptr, threads, smem)
    except Exception:  # older cupy: from the registers and shared memory the kernel takes
        regs = -(-kern.num_regs // 8) * 8
        per_sm = min(65536 // max(regs * threads, 1),
                     dev.attributes["MaxSharedMemoryPerMultiprocessor"] // max(smem + 1024, 1))
    return max(int(per_sm), 1) * dev.attributes["MultiProcessorCount"]


def _allow_smem(kern, smem: int) -> None:
    """Let ``kern`` use ``smem`` bytes of dynamic shared memory (above 48 KiB CUDA needs it
    said once per kernel and size)."""
    if smem > 48 * 1024:
        key = (id(kern), smem)
        if _smem_set.get(key) is not kern:
            kern.max_dynamic_shared_size_bytes = smem
            _smem_set[key] = kern


#: the largest m, n or k a kernel takes: tile origins, tile counts and loop bounds are 32-bit
#: ints in the kernels (element offsets are 64-bit), and a dimension plus a tile (at most 256)
#: must stay below 2^31
MAX_DIM = 2**31 - 2**16

#: the grid's y (and z) limit: steps 1-6 take their row tiles past it in turn (grid "xy")
_GRID_Y = 65535


def _check_sizes(m: int, n: int, k: int) -> None:
    if max(m, n, k) > MAX_DIM:
        raise ValueError(f"m, n, k must be at most 2^31 - 2^16 = {MAX_DIM} for distmm's "
                         f"kernels, got {(m, n, k)}")


def _grid(spec, m: int, n: int, p) -> tuple[int, int, int]:
    """``spec.grid_dims``, with a grid of row tiles in y (steps 1-6) capped at 65535: those
    kernels loop over the row tiles beyond it."""
    if spec.grid == "xy":
        m = min(m, _GRID_Y * spec.tile(p)[0])
    return spec.grid_dims(m, n, p)


def launch(name: str, a, ta: bool, lda: int, b, tb: bool, ldb: int, c, ldc: int,
           m: int, n: int, k: int, *, alpha=1, beta=0, params: Mapping[str, int] | None = None,
           stream=None, compiler: str | None = None, check: bool | None = None,
           defines: Mapping[str, int] | None = None, split_tail: bool | None = None) -> None:
    """Launch ``C = alpha * op(A) @ op(B) + beta * C`` with kernel ``name``.

    ``a``, ``b`` and ``c`` are cupy arrays of one dtype whose first element is the matrix's
    first element; ``lda``/``ldb``/``ldc`` are row strides in elements of the row-major
    stored matrices (A stored m x k, or k x m when ``ta``; likewise B). Runs on ``stream``
    (default: cupy's current stream).

    A tensor-core step (``registry.TC_KERNELS``) goes to ``launch_tc``, its precision read off
    A's dtype (float16: fp16, uint16 bfloat16 bits: bf16, float32: tf32); C is float32.

    Kernels registered with ``split_tail`` (step 10), in float32 and float64, split the
    last, partly filled wave of C tiles along k (``split_tail_plan``): a second launch
    writes the partial sums to a workspace and a fix-up adds them in ascending k, so the
    result is the same on every run (its last bits may differ from the unsplit kernel's).
    ``split_tail=False`` (or ``DISTMM_SPLIT_TAIL=0``) turns it off.

    Raises
    ------
    ValueError
        m, n or k above ``MAX_DIM`` (the kernels' tile indices are 32-bit), or more tiles
        than a grid holds.
    KernelLaunchError
        The launch failed, or (with ``check``, or ``DISTMM_CHECK_LAUNCHES=1``) the kernel
        failed while running.
    """
    import cupy

    if name in registry.TC_KERNELS:  # a tensor-core step: its precision read off A's dtype
        launch_tc(name, a, ta, lda, b, tb, ldb, c, ldc, m, n, k, alpha=alpha, beta=beta,
                  precision=_precision_of(name, a.dtype), params=params or None, stream=stream,
                  compiler=compiler, check=check)
        return
    if m == 0 or n == 0:
        return
    _check_sizes(m, n, k)
    spec = registry.get(name)
    dtype = np.dtype(c.dtype).name
    for nm, x in (("a", a), ("b", b)):
        if x.dtype != c.dtype:
            raise TypeError(f"operand {nm} is {x.dtype} but C is {c.dtype}")
    p = spec.params(dtype, params)
    kern = get_kernel(name, dtype, p, ta, tb, compiler, defines)
    threads = spec.threads(p)
    smem = spec.smem_bytes(dtype, p, ta, tb)
    _allow_smem(kern, smem)
    grid = _grid(spec, m, n, p)
    flags = (int(bool(ta)) | int(bool(tb)) << 1 | int(k > 0 and _operand_flags(a, lda)) << 2
             | int(k > 0 and _operand_flags(b, ldb)) << 3)
    scalar = np.dtype(dtype).type
    if split_tail is None:
        split_tail = os.environ.get("DISTMM_SPLIT_TAIL", "1") not in ("", "0")
    r, s = 0, 1
    if split_tail and spec.split_tail and dtype in ("float32", "float64"):
        bm, bn = spec.tile(p)
        r, s = split_tail_plan(grid[0], _slots(kern, threads, smem), -(-k // p["BK"]))

    def go(kernel, grid_, args, what):
        try:
            kernel(grid_, (threads, 1, 1), args, shared_mem=smem if kernel is kern else 0, stream=stream)
        except Exception as exc:  # cupy raises CUDADriverError for a failed cuLaunchKernel
            raise KernelLaunchError(f"launch of {spec.name} {what} ({dtype}, {p}, grid {grid_}, "
                                    f"{threads} threads, {smem} B smem) failed: {exc}") from exc

    args = (np.int32(m), np.int32(n), np.int32(k), scalar(alpha), a, np.int64(lda), b,
            np.int64(ldb), scalar(beta), c, np.int64(ldc), np.int32(flags))
    if r == 0:
        go(kern, grid, args, "")
    else:
        # the workspace is allocated on the launch stream, so that CuPy's pool does not hand
        # it to another stream's allocation before the fix-up has read it
        st = stream if stream is not None else cupy.cuda.get_current_stream()
        with cupy.cuda.Device(c.device.id), st:
            if grid[0] > r:
                go(kern, (grid[0] - r, 1, 1), args, "(all but the last wave)")
            work = cupy.empty((s, r, bm * bn), dtype=dtype)
            go(kern, (r, s, 1), args[:9] + (work, np.int64(bn), np.int32(flags | 16)),
               f"(split tail: {r} tiles x {s} k ranges)")
            m0, n0 = _tail_origins(c.device.id, m, n, bm, bn, r)
            total = r * bm * bn
            fix = _fixup_kernel(registry.C_TYPES[dtype])
            try:
                fix(((total + 255) // 256,), (256,),
                    (work, m0, n0, np.int32(r), np.int32(s), np.int32(bm), np.int32(bn), np.int32(m),
                     np.int32(n), scalar(alpha), scalar(beta), c, np.int64(ldc)), stream=stream)
            except Exception as exc:
                raise KernelLaunchError(f"split-tail fix-up of {spec.name} failed: {exc}") from exc
    if check is None:
        check = os.environ.get("DISTMM_CHECK_LAUNCHES", "0") not in ("", "0")
    if check:
        st = stream if stream is not None else cupy.cuda.get_current_stream()
        try:
            st.synchronize()
        except Exception as exc:
            raise KernelLaunchError(f"{spec.name} ({dtype}, {p}) failed while running: {exc}") from exc


# -- ahead-of-time compilation ---------------------------------------------------------

def _warm_one(item) -> str:
    name, dtype, params_key, ta, tb, compiler, defines = item
    try:
        if name in registry.TC_KERNELS:
            get_tc_kernel(name, dtype, dict(params_key), ta, tb, compiler).kernel  # noqa: B018
        else:
            get_kernel(name, dtype, dict(params_key), ta, tb, compiler, dict(defines)).kernel  # noqa: B018
        return ""
    except Exception as exc:  # reported by the parent
        return f"{name} {dtype} {dict(params_key)} ta={ta} tb={tb} {dict(defines)}: {exc}"


def warm(items: Iterable[tuple], processes: int | None = None) -> list[str]:
    """Compile kernels ahead of time in parallel processes, filling CuPy's disk cache.

    ``items`` are ``(name, dtype, params or None, ta, tb)``, optionally with a sixth element,
    ``defines`` (see ``get_kernel``); for a tensor-core step (``registry.TC_KERNELS``) dtype
    is its input format ("float32", "bfloat16", "float16"). Returns error messages (empty
    when all compiled). Later loads in any process read the cache.
    """
    import concurrent.futures as cf
    import multiprocessing as mp

    todo = []
    compiler = os.environ.get("DISTMM_CUDA_COMPILER", "nvrtc")
    for name, dtype, params, ta, tb, *rest in items:
        if name in registry.TC_KERNELS:
            spec = registry.get_tc(name)
            dt = registry._tc_dtype(dtype)
            p = spec.params(dt, params)
            todo.append((name, dt, tuple(sorted(p.items())), bool(ta), bool(tb), compiler, ()))
            continue
        spec = registry.get(name)
        dt = np.dtype(dtype).name
        p = spec.params(dt, params)
        if not spec.layout_template:
            ta = tb = False
        defines = tuple(sorted((rest[0] or {}).items())) if rest else ()
        todo.append((name, dt, tuple(sorted(p.items())), bool(ta), bool(tb), compiler, defines))
    todo = list(dict.fromkeys(todo))
    if not todo:
        return []
    processes = processes or min(len(todo), max(1, (os.cpu_count() or 2) - 1), 16)
    if processes <= 1:
        return [e for e in map(_warm_one, todo) if e]
    with cf.ProcessPoolExecutor(processes, mp_context=mp.get_context("spawn")) as pool:
        return [e for e in pool.map(_warm_one, todo) if e]


# -- tensor-core steps (reduced precision: registry.TC_KERNELS) ------------------------

def tc_instantiation(expr: str, in_ctype: str, tma: bool = False) -> str:
    """The explicit instantiation of a tensor-core kernel (inputs ``in_ctype``, C float;
    ``tma``: steps 14 and 15's signature, A and B as tensor maps)."""
    if tma:
        return (f"template __global__ void {expr}(int, int, int, float, const __grid_constant__ "
                f"distmm_tmap, const __grid_constant__ distmm_tmap, float, float*, long long);\n")
    return (f"template __global__ void {expr}(int, int, int, float, const {in_ctype}*, long long, "
            f"const {in_ctype}*, long long, float, float*, long long, int);\n")


@functools.lru_cache(maxsize=None)
def _tc_kernel(name: str, dtype: str, params_key: tuple, ta: bool, tb: bool, compiler: str):
    import cupy

    spec = registry.get_tc(name)
    expr = spec.name_expression(dtype, dict(params_key), ta, tb)
    ctype = registry.TC_INPUT_TYPES[dtype]
    inst = tc_instantiation(expr, ctype, spec.tma)
    if compiler == "nvcc" or spec.arch_suffix or spec.tma:
        # sm_90a (wgmma) is an nvcc target here: NVRTC through cupy compiles for the
        # device's plain compute capability; a kernel taking tensor maps is found by the
        # cubin's one symbol (mangled_name knows only the pointer signatures)
        return _compile_nvcc(spec, expr, ctype, inst=inst, arch_suffix=spec.arch_suffix)
    module = cupy.RawModule(code=source(spec.file) + "\n" + inst, options=OPTIONS)
    return module.get_function(mangled_name(expr))


def get_tc_kernel(name: str, dtype, params: Mapping[str, int] | None = None, ta: bool = False,
                  tb: bool = False, compiler: str | None = None):
    """The loaded tensor-core kernel ``name`` for input format ``dtype`` ("float32",
    "bfloat16" or "float16"); compiled on first use (NVRTC, or nvcc for sm_90a and for the
    steps that take tensor maps)."""
    spec = registry.get_tc(name)
    dtype = registry._tc_dtype(dtype)
    if dtype not in spec.inputs:
        raise TypeError(f"kernel {name} has no {dtype} instantiation (has {spec.inputs})")
    p = spec.params(dtype, params)
    compiler = compiler or os.environ.get("DISTMM_CUDA_COMPILER", "nvrtc")
    if compiler not in ("nvrtc", "nvcc"):
        raise ValueError(f"compiler must be 'nvrtc' or 'nvcc', got {compiler!r}")
    return _tc_kernel(name, dtype, tuple(sorted(p.items())), bool(ta), bool(tb), compiler)


def to_input_format(x, fmt: str, precision: str | None = None, *, transpose: bool = False):
    """A C-contiguous copy of the 2-D cupy array ``x`` (of ``x.T`` with ``transpose``) in
    input format ``fmt``: float32 unchanged, or rounded to TF32 when ``precision`` is
    ``"tf32"`` (steps 11, 14 and 15 read rounded operands: ``cublas.to_input_format``'s rounding,
    ties away from zero, NaN kept; transposed in the same pass), float16 rounded to nearest
    even by cupy, bfloat16 rounded to nearest even (NaN kept quiet) and returned as its
    uint16 bits. Arrays already in the format (float16, or uint16 bfloat16 bits) are only
    made contiguous."""
    import cupy

    if fmt == "float32" and precision == "tf32":
        from distmm.executor.cublas import to_input_format as rounded

        return rounded(x, "tf32", transpose=transpose)[0]
    if transpose:
        x = x.T
    if fmt == "float32":
        return cupy.ascontiguousarray(x, dtype=cupy.float32)
    if fmt == "float16":
        return cupy.ascontiguousarray(x, dtype=cupy.float16)
    if fmt != "bfloat16":
        raise ValueError(f"no tensor-core input format {fmt!r}")
    if x.dtype == cupy.uint16:  # already bfloat16 bits
        return cupy.ascontiguousarray(x)
    # one elementwise pass into the uint16 copy: no 32-bit temporaries the size of x, as
    # cupy's array operators would make (several, for a 10 GB operand)
    from distmm.executor.cublas import to_input_format as rounded

    return rounded(x, "bf16")[0]


#: the step that writes beta C for k = 0 in place of a step reading tensor maps (a map has no
#: empty dimension), by precision: the one before it that reads pointers, for the same inputs
TMA_K_ZERO = {"wgmma_tma": {"bf16": "wgmma_bf16", "fp16": "wgmma_bf16", "tf32": "mma_tf32"},
              "mma_tma": {"bf16": "mma_bf16", "fp16": "mma_bf16", "tf32": "mma_tf32"}}


def launch_tc(name: str, a, ta: bool, lda: int, b, tb: bool, ldb: int, c, ldc: int,
              m: int, n: int, k: int, *, precision: str, alpha=1.0, beta=0.0,
              params: Mapping[str, int] | None = None, stream=None, compiler: str | None = None,
              check: bool | None = None) -> None:
    """Launch tensor-core kernel ``name`` (``registry.kernel_for``): ``C = alpha op(A) op(B)
    + beta C`` in ``precision``, C float32.

    ``a`` and ``b`` are stored as in ``launch`` (row strides ``lda``, ``ldb`` in elements),
    either float32 or already in the precision's input format (float16, or bfloat16 bits as
    uint16). float32 operands of ``"bf16"`` / ``"fp16"`` are first converted on the GPU to
    contiguous copies (``to_input_format``: one rounding to nearest, as cuBLAS's callers
    convert before ``cublasGemmEx``); under ``"tf32"`` they are rounded to TF32 copies the
    same way (ties away from zero, cuBLAS's TF32 rounding), which steps 11, 14 and 15 read as
    they are.
    Steps 14 and 15 (``spec.tma``) read operands through tensor maps: an operand whose base or
    rows are not a multiple of 16 bytes is first copied (rows padded); k = 0 goes to the step
    before them that reads pointers (``TMA_K_ZERO``). Steps 14 and 15 under ``"tf32"`` read both
    operands k-major (A stored M x K, B stored N x K): an operand stored otherwise is rounded
    into a transposed copy, in the same pass as the rounding.

    Returns
    -------
    str
        The name of the kernel that ran (``name``, or ``TMA_K_ZERO[name][precision]`` for
        k = 0).

    Raises
    ------
    ValueError
        An unknown precision, or one the kernel does not compute; m, n or k above
        ``MAX_DIM``, or more tiles than a grid holds.
    TypeError
        C is not float32.
    KernelLaunchError
        As ``launch``.
    """
    import cupy

    spec = registry.get_tc(name)
    if precision not in spec.precisions:
        raise ValueError(f"kernel {name} computes {', '.join(spec.precisions)}, not {precision!r}")
    if c.dtype != np.float32:
        raise TypeError(f"C must be float32 for tensor-core kernels, got {c.dtype}")
    if m == 0 or n == 0:
        return name
    _check_sizes(m, n, k)
    fmt = spec.precisions[precision]
    st = stream if stream is not None else cupy.cuda.get_current_stream()
    with st:
        if fmt != "float32" or a.dtype != np.float32 or precision == "tf32":
            rows_a, cols_a = (k, m) if ta else (m, k)
            rows_b, cols_b = (n, k) if tb else (k, n)
            # TF32 on the TMA steps: no transposed wgmma or ldmatrix of 32-bit inputs, so
            # both operands k-major
            kmajor = spec.kmajor_only(fmt)
            a = to_input_format(_stored(a, rows_a, cols_a, lda), fmt, precision,
                                transpose=kmajor and ta)
            b = to_input_format(_stored(b, rows_b, cols_b, ldb), fmt, precision,
                                transpose=kmajor and not tb)
            if kmajor:
                ta, tb = False, True
            lda, ldb = max(a.shape[1], 1), max(b.shape[1], 1)
            if spec.tma:
                (a, lda), (b, ldb) = _tma_ready(a), _tma_ready(b)
                if k == 0:  # no tensor map has an empty dimension: a step that reads
                    # pointers writes beta C
                    return launch_tc(TMA_K_ZERO[name][precision], a, ta, lda, b, tb, ldb, c,
                                     ldc, m, n, k, precision=precision, alpha=alpha, beta=beta,
                                     stream=st, compiler=compiler, check=check)
                p = _launch_tma(spec, fmt, params, a, ta, lda, b, tb, ldb, c, ldc, m, n, k,
                                alpha, beta, st, compiler)
                return _checked(name, precision, p, st, check)
        p = spec.params(fmt, params)
        kern = get_tc_kernel(name, fmt, p, ta, tb, compiler)
        threads = spec.threads(p)
        smem = spec.smem_bytes(fmt, p, ta, tb)
        _allow_smem(kern, smem)
        grid = spec.grid_dims(m, n, p)
        flags = (int(bool(ta)) | int(bool(tb)) << 1 | int(k > 0 and _operand_flags(a, lda)) << 2
                 | int(k > 0 and _operand_flags(b, ldb)) << 3)
        args = (np.int32(m), np.int32(n), np.int32(k), np.float32(alpha), a, np.int64(lda), b,
                np.int64(ldb), np.float32(beta), c, np.int64(ldc), np.int32(flags))
        try:
            kern(grid, (threads, 1, 1), args, shared_mem=smem, stream=st)
        except Exception as exc:
            raise KernelLaunchError(f"launch of {name} ({precision}, {p}, grid {grid}, {threads} "
                                    f"threads, {smem} B smem) failed: {exc}") from exc
    return _checked(name, precision, p, st, check)


def _checked(name: str, precision: str, p, st, check: bool | None) -> str:
    """``name``, after waiting for the launch on ``st`` when ``check`` (or
    ``DISTMM_CHECK_LAUNCHES``) asks for it: a fault inside the kernel raises here."""
    if check is None:
        check = os.environ.get("DISTMM_CHECK_LAUNCHES", "0") not in ("", "0")
    if check:
        try:
            st.synchronize()
        except Exception as exc:
            raise KernelLaunchError(
                f"{name} ({precision}, {p}) failed while running: {exc}") from exc
    return name


def _tma_ready(x):
    """``(x, ld)`` for a contiguous 2-D array of 16- or 32-bit elements: itself when a tensor map can
    describe it (16-byte aligned base, rows a multiple of 16 bytes), else a copy in a fresh
    allocation with rows padded to 16 bytes (the padding is never read: the map's width is
    the matrix's). The copy costs one pass over the operand; step 13, which reads any
    layout, runs several times slower."""
    import cupy

    rows, cols = x.shape
    if rows == 0 or cols == 0 or tma.eligible(int(x.data.ptr), rows, cols, cols, x.itemsize):
        return x, max(cols, 1)
    ld = -(-cols * x.itemsize // 16) * 16 // x.itemsize
    out = cupy.empty((rows, ld), dtype=x.dtype)[:, :cols]
    out[...] = x
    return out, ld


def _launch_tma(spec, fmt: str, params, a, ta: bool, lda: int, b, tb: bool, ldb: int, c,
                ldc: int, m: int, n: int, k: int, alpha, beta, st, compiler) -> dict:
    """The launch of a step that reads tensor maps (14, 15): maps of A and B as stored (``tma.encode_2d``, boxes from
    ``tma.box_for``) and the kernel's parameters passed to the driver by value. Returns the
    parameters it ran with."""
    import ctypes

    p = spec.params(fmt, params)
    kern = get_tc_kernel(spec.name, fmt, p, ta, tb, compiler)
    rows_a, cols_a = (k, m) if ta else (m, k)
    rows_b, cols_b = (n, k) if tb else (k, n)
    map_a = tma.encode_2d(int(a.data.ptr), rows_a, cols_a, lda,
                          tma.box_for(not ta, p["BM"], a.itemsize), a.itemsize)
    map_b = tma.encode_2d(int(b.data.ptr), rows_b, cols_b, ldb,
                          tma.box_for(tb, p["BN"], b.itemsize), b.itemsize)
    threads = spec.threads(p)
    smem = spec.smem_bytes(fmt, p, ta, tb)
    _allow_smem(kern, smem)
    grid = spec.grid_dims(m, n, p)
    args = (ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k), ctypes.c_float(alpha), map_a,
            map_b, ctypes.c_float(beta), ctypes.c_uint64(int(c.data.ptr)), ctypes.c_longlong(ldc))
    try:
        fn = getattr(kern, "kernel", kern)  # a RawKernel's loaded Function
        tma.launch(fn.ptr, grid, (threads, 1, 1), smem, st.ptr, args)
    except Exception as exc:
        raise KernelLaunchError(f"launch of {spec.name} ({fmt}, {p}, grid {grid}, {threads} "
                                f"threads, {smem} B smem) failed: {exc}") from exc
    return p


def _precision_of(name: str, dtype) -> str:
    """The precision a tensor-core kernel computes for operands of ``dtype`` handed to
    ``launch``: float16 -> "fp16", uint16 (bfloat16 bits) -> "bf16", float32 -> the kernel's
    one float32 mode ("tf32"); ``launch_tc`` names it explicitly instead."""
    spec = registry.get_tc(name)
    by_dtype = {"float16": "fp16", "uint16": "bf16"}
    dt = np.dtype(dtype).name
    modes = [p for p in spec.precisions if by_dtype.get(dt) == p
             or (dt == "float32" and spec.precisions[p] == "float32")]
    if len(modes) != 1:
        raise TypeError(f"kernel {name} takes {', '.join(spec.precisions)} operands, not {dt} "
                        "(float32 inputs of bf16/fp16 go through launch_tc(precision=...))")
    return modes[0]


def _stored(x, rows: int, cols: int, ld: int):
    """``x`` checked to be the stored rows x cols operand (a 2-D view whose row stride is
    ``ld`` elements, as ``launch`` takes it)."""
    if x.ndim != 2 or x.shape != (rows, cols):
        raise ValueError(f"operand is {x.shape}, expected the stored ({rows}, {cols}) matrix")
    if rows > 1 and cols > 0 and x.strides[0] != ld * x.itemsize:
        raise ValueError(f"operand's row stride is {x.strides[0] // x.itemsize} elements, "
                         f"ld is {ld}")
    return x
