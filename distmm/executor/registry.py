"""The one table of distmm's CUDA GEMM kernels.

This module covers: every kernel in ``kernels/cuda/`` (one optimisation step per file;
steps 1-10 in ``KERNELS``, the reduced-precision tensor-core steps 11-15 in ``TC_KERNELS``
with ``kernel_for``, the lookup by precision and compute capability),
its template parameters, their defaults per dtype, the autotuner's search space and the
constraints a configuration must meet, and the launch geometry (threads, tile, grid,
dynamic shared memory) derived from them. The loader (``distmm.executor.cuda_loader``),
the GPU tests, the benchmarks and ``distmm tune`` (``distmm.cli.tune``) all read this table; none keeps its own
list of kernels.

It does *not* cover: compiling or launching (``distmm.executor.cuda_loader``), choosing
between kernels and cuBLAS (``distmm.executor.gpu``), or the tuned configurations
(``distmm.executor.tuning``). Pure Python, numpy only: importable
without cupy or a GPU.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

__all__ = ["KernelSpec", "KERNELS", "DTYPES", "C_TYPES", "get", "steps", "best_kernel",
           "kernel_params", "config_problem", "MAX_SMEM_BYTES", "TensorCoreSpec", "TC_KERNELS",
           "TC_INPUT_TYPES", "PRECISION_KERNELS", "PRECISION_INPUT", "get_tc", "tc_steps",
           "kernel_for"]

#: numpy dtype name -> C++ element type of the kernels
C_TYPES = {"float32": "float", "float64": "double", "int32": "int", "int64": "long long"}
DTYPES = tuple(C_TYPES)

#: opt-in dynamic shared memory per block on sm_80 (163 KiB) and sm_90 (227 KiB)
MAX_SMEM_BYTES = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def _vec(dtype: str) -> int:
    return 16 // np.dtype(dtype).itemsize


@dataclass(frozen=True)
class KernelSpec:
    """One kernel of the family.

    Attributes
    ----------
    name : str
        Short name used in ``backend="raw"`` choices, records (``distmm-raw-<name>``) and tests.
    step : int
        Position in the optimisation sequence (the file's number).
    file : str
        Source file under ``kernels/cuda/``.
    title : str
        What the step adds, for tables and plots.
    template : str
        The ``__global__`` template's name expression with ``{T}``, ``{TA}``, ``{TB}`` and the
        tunable parameters as format fields.
    defaults : mapping
        dtype name -> template parameters (empty for kernels with none).
    fixed : mapping
        Launch geometry of kernels without tunable parameters: ``threads``, ``BM``, ``BN``.
    layout_template : bool
        Whether the transpose flags are template parameters (``{TA}``, ``{TB}``) rather than
        run-time flags.
    grid : str
        ``"xy"``: blockIdx.x over column tiles, blockIdx.y over row tiles; ``"linear"``: a
        1-D grid of all tiles (the kernel orders them itself).
    min_cc : int
        Lowest compute capability (10 * major + minor) the kernel runs on.
    tune_space : mapping
        For tunable kernels: parameter -> candidate values (see ``candidates``).
    raw_choice : bool
        Whether the kernel can be ``best_kernel()`` (what ``backend="raw"`` and ``distmm
        tune`` use). False for side steps that the tests and benchmarks cover but that are
        not the raw backend's kernel (step 10, the SIMT float64 study).
    split_tail : bool
        Whether the kernel can compute the last, partly filled wave of tiles split along k
        (flag ``DISTMM_SPLIT_TAIL``; see ``cuda_loader.launch``). Step 10 only.
    """

    name: str
    step: int
    file: str
    title: str
    template: str
    defaults: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    fixed: Mapping[str, int] = field(default_factory=dict)
    layout_template: bool = False
    grid: str = "xy"
    min_cc: int = 70
    tune_space: Mapping[str, tuple] = field(default_factory=dict)
    dtypes: tuple[str, ...] = DTYPES
    raw_choice: bool = True
    split_tail: bool = False

    # -- parameters -----------------------------------------------------------------
    def _dmma(self, dtype: str) -> bool:
        """Whether this kernel runs ``dtype`` on the FP64 tensor cores (step 9, float64)."""
        return self.name == "dmma" and np.dtype(dtype).name == "float64"

    @property
    def tunable(self) -> bool:
        return bool(self.tune_space)

    def params(self, dtype: str, params: Mapping[str, int] | None = None) -> dict[str, int]:
        """The template parameters to use: ``params`` if given, else the dtype's defaults."""
        dtype = np.dtype(dtype).name
        if params is not None and self.tunable:
            return {k: int(params[k]) for k in self.defaults[dtype]}
        return dict(self.defaults.get(dtype, {}))

    def threads(self, p: Mapping[str, int]) -> int:
        if self.tunable:
            return (p["BM"] // p["WM"]) * (p["BN"] // p["WN"]) * 32
        return self.fixed["threads"]

    def tile(self, p: Mapping[str, int]) -> tuple[int, int]:
        """(BM, BN): the C tile one block computes."""
        if self.tunable:
            return p["BM"], p["BN"]
        return self.fixed["BM"], self.fixed["BN"]

    def smem_bytes(self, dtype: str, p: Mapping[str, int], ta: bool, tb: bool) -> int:
        """Dynamic shared memory per block; mirrors ``PipelinedShape`` in pipelined.cuh."""
        if self.name not in ("double_buffer", "warptile", "dmma", "simt_fp64"):
            return 0
        if self.name == "double_buffer":
            p = {"BM": 128, "BN": 128, "BK": 8, "STAGES": 2}
        v = _vec(dtype)
        bm, bn, bk, stages = p["BM"], p["BN"], p["BK"], p["STAGES"]
        if self._dmma(dtype):  # DmmaShape in 09_dmma.cu: every row padded by 4 doubles
            a_rows, a_cols = (bk, bm) if ta else (bm, bk)
            b_rows, b_cols = (bn, bk) if tb else (bk, bn)
            return stages * (a_rows * (a_cols + 4) + b_rows * (b_cols + 4)) * 8
        a_ld = (bm if ta else bk + (v if (bk // v) % 2 == 0 else 0))
        a_rows = bk if ta else bm
        b_ld = (bk + (v if (bk // v) % 2 == 0 else 0)) if tb else bn
        b_rows = bn if tb else bk
        return stages * (a_rows * a_ld + b_rows * b_ld) * np.dtype(dtype).itemsize

    def name_expression(self, dtype: str, p: Mapping[str, int], ta: bool, tb: bool) -> str:
        """The C++ name expression of one instantiation, for ``RawModule(name_expressions=)``."""
        dtype = np.dtype(dtype).name
        fmt = dict(p, T=C_TYPES[dtype], TA=str(bool(ta)).lower(), TB=str(bool(tb)).lower())
        return self.template.format(**fmt)

    def violations(self, dtype: str, p: Mapping[str, int], cc: int = 90) -> list[str]:
        """Constraints ``p`` breaks for ``dtype`` on compute capability ``cc`` (empty: valid)."""
        dtype = np.dtype(dtype).name
        out = []
        if dtype not in self.dtypes:
            out.append(f"{self.name} has no {dtype} instantiation")
        if cc < self.min_cc:
            out.append(f"{self.name} needs compute capability {self.min_cc}, device has {cc}")
        if not self.tunable:
            return out
        v = _vec(dtype)
        bm, bn, bk, wm, wn, tm, tn = (p[k] for k in ("BM", "BN", "BK", "WM", "WN", "TM", "TN"))
        if (wm // tm) * (wn // tn) != 32 or wm % tm or wn % tn:
            out.append(f"warp tile {wm}x{wn} over thread tile {tm}x{tn} is not 32 lanes")
        if bm % wm or bn % wn:
            out.append(f"block tile {bm}x{bn} is not a multiple of warp tile {wm}x{wn}")
        if tm % v or tn % v or bk % v:
            out.append(f"TM, TN and BK must be multiples of the 16-byte vector ({v} {dtype})")
        if self._dmma(dtype):
            # 8 x 8 DMMA tiles; TM x TN only counts a thread's accumulators (TM = 8 names
            # each warp tile once); rows padded to 4 or 12 mod 16 doubles need multiples of 8
            if tm != 8:
                out.append("DMMA (float64): TM must be 8 (TM x TN only counts accumulators)")
            if wm % 8 or wn % 8 or bm % 8 or bn % 8 or bk % 8:
                out.append("DMMA (float64): WM, WN, BM, BN and BK must be multiples of 8")
        threads = self.threads(p)
        if not 64 <= threads <= 1024:
            out.append(f"{threads} threads per block (64..1024 allowed)")
        words = tm * tn * np.dtype(dtype).itemsize // 4
        minb = p.get("MINB", 1)
        cap = min(255, 65536 // (max(minb, 1) * threads)) if threads else 255
        if words > cap // 2 + 1:
            out.append(f"{tm}x{tn} accumulators take {words} registers, more than half of "
                       f"the {cap} a thread may use")
        if minb > 1 and cap >= 255:
            out.append(f"MINB={minb} leaves the register limit at 255: the same kernel as MINB=1")
        limit = MAX_SMEM_BYTES.get(cc, 99 * 1024)
        smem = max(self.smem_bytes(dtype, p, ta, tb) for ta in (0, 1) for tb in (0, 1))
        if smem > limit:
            out.append(f"{smem} bytes of shared memory (at most {limit} on sm_{cc})")
        if p["STAGES"] < 2:
            out.append("at least 2 pipeline stages")
        if minb not in (1, 2, 3, 4):
            out.append(f"MINB (blocks per SM the register budget allows) must be 1..4, got {minb}")
        elif minb > 1 and minb * smem > MAX_SMEM_BYTES.get(cc, 99 * 1024) + 1024:
            out.append(f"{minb} blocks of {smem} bytes of shared memory do not fit one SM")
        return out

    def candidates(self, dtype: str, cc: int = 90) -> list[dict[str, int]]:
        """Every valid configuration of the tuning space for ``dtype`` (defaults first)."""
        dtype = np.dtype(dtype).name
        if not self.tunable:
            return [self.params(dtype)]
        space = self.tune_space
        out = [self.params(dtype)]
        for blk, bk, warp, stages, minb in itertools.product(
                space["block"], space["BK"], space["warp"], space["STAGES"], space["MINB"]):
            p = {"BM": blk[0], "BN": blk[1], "BK": bk, "WM": warp[0], "WN": warp[1],
                 "TM": warp[2], "TN": warp[3], "STAGES": stages, "MINB": minb}
            if p not in out and not self.violations(dtype, p, cc):
                out.append(p)
        return out

    def grid_dims(self, m: int, n: int, p: Mapping[str, int]) -> tuple[int, int, int]:
        bm, bn = self.tile(p)
        gm, gn = -(-m // bm), -(-n // bn)
        if self.grid == "linear":
            if gm * gn >= 2**31:
                raise ValueError(f"{m}x{n} needs {gm * gn} blocks of {bm}x{bn}; at most 2^31 - 1")
            return gm * gn, 1, 1
        if gm > 65535:
            raise ValueError(f"{m} rows need {gm} row tiles of {bm}; a grid holds at most 65535")
        return gn, gm, 1


_WARP_SHAPES = (  # (WM, WN, TM, TN): 32 lanes each
    (32, 64, 8, 8), (64, 32, 8, 8), (64, 64, 8, 16), (64, 64, 16, 8), (32, 128, 8, 16),
    (32, 32, 4, 8), (32, 32, 8, 4), (64, 32, 16, 4), (32, 64, 4, 16),
)

#: the search space of the warp-tiled steps (8 and 9 share their block/warp structure)
_WARPTILE_SPACE = {
    "block": ((128, 128), (128, 256), (256, 128), (128, 64), (64, 128), (64, 64)),
    "BK": (8, 16, 32),
    "warp": _WARP_SHAPES,
    "STAGES": (2, 3, 4),
    "MINB": (1, 2, 3, 4),
}

KERNELS: dict[str, KernelSpec] = {k.name: k for k in (
    KernelSpec("naive", 1, "01_naive.cu", "naive (rows across threads)",
               "distmm_gemm_naive<{T}>", fixed={"threads": 256, "BM": 8, "BN": 32}),
    KernelSpec("coalesced", 2, "02_coalesced.cu", "global-memory coalescing",
               "distmm_gemm_coalesced<{T}>", fixed={"threads": 256, "BM": 8, "BN": 32}),
    KernelSpec("smem", 3, "03_smem.cu", "shared-memory tiles 32x32, padded",
               "distmm_gemm_smem<{T}>", fixed={"threads": 1024, "BM": 32, "BN": 32}),
    KernelSpec("blocktile1d", 4, "04_blocktile1d.cu", "1D register blocking (8 per thread)",
               "distmm_gemm_blocktile1d<{T}>", fixed={"threads": 512, "BM": 64, "BN": 64}),
    KernelSpec("blocktile2d", 5, "05_blocktile2d.cu", "2D register blocking (8x8 per thread)",
               "distmm_gemm_blocktile2d<{T}>", fixed={"threads": 256, "BM": 128, "BN": 128}),
    KernelSpec("vectorized", 6, "06_vectorized.cu", "16-byte loads, transposed A in smem",
               "distmm_gemm_vectorized<{T},{TA},{TB}>", layout_template=True,
               fixed={"threads": 256, "BM": 128, "BN": 128}),
    KernelSpec("double_buffer", 7, "07_double_buffer.cu", "cp.async double buffering",
               "distmm_gemm_double_buffer<{T},{TA},{TB}>", layout_template=True,
               fixed={"threads": 256, "BM": 128, "BN": 128}, grid="linear", min_cc=80),
    KernelSpec(
        "warptile", 8, "08_warptile.cu", "warp tiling + multi-stage cp.async",
        "distmm_gemm_warptile<{T},{BM},{BN},{BK},{WM},{WN},{TM},{TN},{STAGES},{MINB},{TA},{TB}>",
        layout_template=True, grid="linear", min_cc=80,
        defaults={
            "float32": {"BM": 64, "BN": 128, "BK": 16, "WM": 32, "WN": 64, "TM": 8, "TN": 8, "STAGES": 3, "MINB": 1},
            "int32": {"BM": 128, "BN": 128, "BK": 16, "WM": 32, "WN": 64, "TM": 8, "TN": 8, "STAGES": 3, "MINB": 1},
            "float64": {"BM": 64, "BN": 128, "BK": 16, "WM": 64, "WN": 32, "TM": 8, "TN": 8, "STAGES": 2, "MINB": 1},
            "int64": {"BM": 128, "BN": 64, "BK": 16, "WM": 32, "WN": 32, "TM": 8, "TN": 4, "STAGES": 3, "MINB": 1},
        },
        tune_space=_WARPTILE_SPACE),
    KernelSpec(
        "dmma", 9, "09_dmma.cu", "FP64 tensor cores (mma m16n8k16 on sm_90, m8n8k4 on sm_80); other dtypes as step 8",
        "distmm_gemm_dmma<{T},{BM},{BN},{BK},{WM},{WN},{TM},{TN},{STAGES},{MINB},{TA},{TB}>",
        layout_template=True, grid="linear", min_cc=80,
        defaults={
            # float32: the tuner's best shape for step 8 (bench/NOTES.md, steps 1-8)
            "float32": {"BM": 128, "BN": 256, "BK": 32, "WM": 64, "WN": 64, "TM": 16, "TN": 8, "STAGES": 2, "MINB": 1},
            "int32": {"BM": 128, "BN": 128, "BK": 16, "WM": 32, "WN": 64, "TM": 8, "TN": 8, "STAGES": 3, "MINB": 1},
            # float64: 4 warps of 32 x 32 (32 accumulators a thread): a little below the tuner's
            # best with m16n8k16, the best shape with m8n8k4 (sm_80), and the shape the GPU
            # tests check in every layout
            "float64": {"BM": 64, "BN": 64, "BK": 16, "WM": 32, "WN": 32, "TM": 8, "TN": 4, "STAGES": 3, "MINB": 1},
            "int64": {"BM": 128, "BN": 64, "BK": 16, "WM": 32, "WN": 32, "TM": 8, "TN": 4, "STAGES": 3, "MINB": 1},
        },
        tune_space=_WARPTILE_SPACE),
    KernelSpec(
        # A SIMT side step: benchmarked and tested, never best_kernel() (dmma stays the raw
        # backend's kernel for every dtype; see raw_choice).
        "simt_fp64", 10, "10_simt_fp64.cu",
        "SIMT fp64: small thread tiles, register double-buffered fragments",
        "distmm_gemm_simt_fp64<{T},{BM},{BN},{BK},{WM},{WN},{TM},{TN},{STAGES},{MINB},{TA},{TB}>",
        layout_template=True, grid="linear", min_cc=80, raw_choice=False, split_tail=True,
        defaults={
            # float64 (the target): 4 warps of 64 x 32, 8 x 8 accumulators a thread, 2 blocks
            # per SM; the best 8x8 shape of the search (bench/research/simt64_search.py). 8 x 4
            # thread tiles read shared memory twice as often per FMA and are slower
            # (bench/NOTES.md, step 10).
            "float64": {"BM": 64, "BN": 128, "BK": 16, "WM": 64, "WN": 32, "TM": 8, "TN": 8, "STAGES": 4, "MINB": 1},
            "float32": {"BM": 128, "BN": 64, "BK": 16, "WM": 32, "WN": 32, "TM": 8, "TN": 4, "STAGES": 3, "MINB": 1},
            "int32": {"BM": 128, "BN": 64, "BK": 16, "WM": 32, "WN": 32, "TM": 8, "TN": 4, "STAGES": 3, "MINB": 1},
            # int64 products are several instructions each: MINB = 2 spills, so 1
            "int64": {"BM": 128, "BN": 64, "BK": 16, "WM": 32, "WN": 32, "TM": 8, "TN": 4, "STAGES": 3, "MINB": 1},
        },
        tune_space={
            "block": ((128, 64), (64, 128), (128, 128)),
            "BK": (8, 16, 32),
            # 8 x 4 tiles (occupancy) and 8 x 8 tiles (step 8's reuse, 2 blocks of 128
            # threads per SM at <= 255 registers)
            "warp": ((32, 32, 8, 4), (32, 32, 4, 8), (64, 16, 8, 4), (64, 32, 8, 8), (32, 64, 8, 8)),
            "STAGES": (2, 3, 4),
            "MINB": (1, 2),
        }),
)}


def get(name: str) -> KernelSpec:
    """The spec of kernel ``name``; ``KeyError`` names the known ones."""
    try:
        return KERNELS[name]
    except KeyError:
        raise KeyError(f"no kernel {name!r}; known: {', '.join(KERNELS)}") from None


def steps() -> list[KernelSpec]:
    """Kernels in optimisation order."""
    return sorted(KERNELS.values(), key=lambda k: k.step)


def best_kernel() -> KernelSpec:
    """The last step that may be the raw backend's kernel (``raw_choice``): what
    ``backend="raw"`` runs and ``distmm tune`` tunes."""
    return [k for k in steps() if k.raw_choice][-1]


def kernel_params(spec: KernelSpec, dtype: str, tuned: Mapping[str, Any] | None = None,
                  cc: int = 90) -> dict:
    """Parameters for ``spec`` and ``dtype``: a tuned configuration when ``config_problem``
    finds none in it on compute capability ``cc``, else the defaults."""
    if tuned and spec.tunable and config_problem(spec, dtype, tuned, cc) is None:
        return {k: tuned[k] for k in spec.params(dtype)}  # in the kernel's order
    return spec.params(dtype)


#: tuning-space keys that set several template parameters at once (``candidates``)
_GROUPS = {"block": ("BM", "BN"), "warp": ("WM", "WN", "TM", "TN")}


def config_problem(spec, dtype, params: Any, cc: int = 90) -> str | None:
    """One phrase naming why ``params`` is not a configuration of ``spec`` for ``dtype`` on
    compute capability ``cc`` that ``distmm tune`` could have stored (``candidates``: the
    defaults, or the tuning space's values meeting the constraints), or None.

    What a tuning cache holds is checked with it before a kernel is compiled with it: a
    parameter missing or unknown (the kernel's parameters changed since), a value that is
    not an integer, one outside the tuning space (the constraints mirror the sources'
    ``static_assert`` only there), or a combination that breaks a constraint.
    """
    if params is None:
        return "none given"
    if not isinstance(params, Mapping):
        return f"a {type(params).__name__}, not an object of parameters"
    try:
        defaults = spec.params(dtype)
    except (TypeError, ValueError):
        defaults = {}
    if not defaults:
        return f"{spec.name} has no tuned parameters for {dtype}"
    missing = [k for k in defaults if k not in params]
    extra = [str(k) for k in params if k not in defaults]
    if missing or extra:
        return "; ".join(filter(None, (
            missing and f"no {', '.join(missing)} (parameters of {spec.name} now)",
            extra and f"{', '.join(extra)}: not a parameter of {spec.name}")))
    for key in defaults:
        value = params[key]
        if type(value) is not int:  # JSON's integers; not a bool, a float or a string
            return f"{key}={value!r} is not an integer"
    if all(params[k] == v for k, v in defaults.items()):
        return None
    spaced = set()
    for name, values in spec.tune_space.items():
        keys = _GROUPS.get(name, (name,))[:len(values[0]) if isinstance(values[0], tuple) else 1]
        spaced.update(keys)
        have = tuple(params[k] for k in keys)
        allowed = {v if isinstance(v, tuple) else (v,) for v in values}
        allowed.add(tuple(defaults[k] for k in keys))
        if have not in allowed:
            said = ", ".join(f"{k}={v}" for k, v in zip(keys, have))
            return f"{said}: outside {spec.name}'s tuning space"
    for key in defaults:  # settings outside the space: the defaults' (``candidates``)
        if key not in spaced and params[key] != defaults[key]:
            return f"{key}={params[key]}: {spec.name} is tuned with {key}={defaults[key]} only"
    broken = spec.violations(dtype, params, cc)
    return broken[0] if broken else None


# -- tensor-core steps (reduced precision) ---------------------------------------------

#: numpy dtype name of a tensor-core kernel's input format -> its C++ storage type.
#: bfloat16 has no numpy dtype of its own on the GPU: its bits travel as uint16.
TC_INPUT_TYPES = {"float32": "float", "bfloat16": "distmm_bf16", "float16": "distmm_fp16"}

#: reduced precision mode -> the input format its kernels read
PRECISION_INPUT = {"tf32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class TensorCoreSpec:
    """One tensor-core kernel (steps 11-15): a product in a reduced precision, fp32
    accumulation, float32 C.

    Unlike ``KernelSpec``'s kernels, which compute in the dtype of A, B and C alike, these
    read A and B in an input format (``inputs``: float32 rounded to TF32 inside the kernel,
    or bfloat16 / float16 arrays) and write float32; alpha and beta are float32. Same launch
    geometry rules (linear grid, grouped tile order), one signature::

        (int M, int N, int K, float alpha, const Tin* A, long long lda,
         const Tin* B, long long ldb, float beta, float* C, long long ldc, int flags)

    except steps 14 and 15 (``tma``), which take A and B as tensor maps by value::

        (int M, int N, int K, float alpha, distmm_tmap A, distmm_tmap B, float beta,
         float* C, long long ldc)

    Attributes
    ----------
    name, step, file, title, template
        As ``KernelSpec`` (``{T}`` is the input's C++ type, ``TC_INPUT_TYPES``).
    precisions : mapping
        Precision mode (``"tf32"``, ``"bf16"``, ``"fp16"``) -> the input dtype name.
    min_cc, max_cc : int
        Compute capabilities (10 * major + minor) the kernel runs on, both inclusive.
    arch_suffix : str
        ``"a"`` for kernels built for the architecture-specific target (``sm_90a``: wgmma,
        setmaxnreg), which only nvcc is asked to compile (``cuda_loader``).
    defaults, tune_space
        Default parameters per input dtype and the tuner's space (see ``candidates``).
    """

    name: str
    step: int
    file: str
    title: str
    template: str
    precisions: Mapping[str, str]
    defaults: Mapping[str, Mapping[str, int]]
    tune_space: Mapping[str, tuple]
    min_cc: int = 80
    max_cc: int = 1000
    arch_suffix: str = ""
    layout_template: bool = True
    grid: str = "linear"
    raw_choice: bool = False  # never best_kernel(): chosen by precision (kernel_for)
    tma: bool = False  # takes tensor maps of A and B, not pointers (steps 14, 15; ``tma``)

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.precisions.values()))

    @property
    def tunable(self) -> bool:
        return True

    @property
    def wgmma(self) -> bool:
        return self.name.startswith("wgmma")

    def params(self, dtype: str, params: Mapping[str, int] | None = None) -> dict[str, int]:
        dtype = _tc_dtype(dtype)
        if params is not None:  # a parameter added since ``params`` was saved: its default
            return {k: int(params.get(k, v)) for k, v in self.defaults[dtype].items()}
        return dict(self.defaults.get(dtype, {}))

    def threads(self, p: Mapping[str, int]) -> int:
        if self.wgmma:  # a producer warpgroup and one consumer warpgroup per 64 rows
            return 128 * (p["BM"] // 64 + 1)
        # the computing warps, + a producer warpgroup with SYNC 2 (step 15)
        warps = (p["BM"] // p["WM"]) * (p["BN"] // p["WN"])
        return 32 * warps + (128 if p.get("SYNC") == 2 else 0)

    def tile(self, p: Mapping[str, int]) -> tuple[int, int]:
        return p["BM"], p["BN"]

    def smem_bytes(self, dtype: str, p: Mapping[str, int], ta: bool = False,
                   tb: bool = False) -> int:
        """Dynamic shared memory per block (``Tf32Shape``, ``Mma16Shape``, ``WgmmaShape``,
        ``TmaShape``); the same in every layout (no padding: the tiles are swizzled)."""
        size = np.dtype(_np_dtype(dtype)).itemsize
        data = p["STAGES"] * (p["BM"] + p["BN"]) * p["BK"] * size
        if self.tma:  # + 1024 to align the stages to the 128-byte swizzle's 1024-byte pattern
            data += 1024
        # mbarriers: a full and an empty one a stage (wgmma, and the steps fed by TMA)
        return data + (16 * p["STAGES"] if self.wgmma or self.tma else 0)

    def name_expression(self, dtype: str, p: Mapping[str, int], ta: bool, tb: bool) -> str:
        fmt = dict(p, T=TC_INPUT_TYPES[_tc_dtype(dtype)], TA=str(bool(ta)).lower(),
                   TB=str(bool(tb)).lower())
        return self.template.format(**fmt)

    def runs_on(self, cc: int) -> bool:
        return self.min_cc <= cc <= self.max_cc

    def kmajor_only(self, dtype: str) -> bool:
        """Whether the kernel reads input ``dtype`` k-major only (A stored M x K, B stored
        N x K): TF32 values (float32) on the steps fed by TMA, whose mma reads 32-bit inputs
        untransposed; ``cuda_loader.launch_tc`` hands them k-major copies."""
        return self.tma and _tc_dtype(dtype) == "float32"

    def layouts(self, dtype: str) -> list[tuple[bool, bool]]:
        """The (TA, TB) instantiations input ``dtype`` is launched with."""
        if self.kmajor_only(dtype):
            return [(False, True)]
        return [(ta, tb) for ta in (False, True) for tb in (False, True)]

    def violations(self, dtype: str, p: Mapping[str, int], cc: int = 90) -> list[str]:
        """Constraints ``p`` breaks for input ``dtype`` on compute capability ``cc``."""
        dtype = _tc_dtype(dtype)
        out = []
        if dtype not in self.inputs:
            out.append(f"{self.name} has no {dtype} instantiation (has {', '.join(self.inputs)})")
            return out
        if not self.runs_on(cc):
            need = (f"compute capability {self.min_cc}" if self.min_cc == self.max_cc
                    else f"compute capability >= {self.min_cc}")
            out.append(f"{self.name} needs {need}, device has {cc}")
        size = np.dtype(_np_dtype(dtype)).itemsize
        bm, bn, bk, stages = p["BM"], p["BN"], p["BK"], p["STAGES"]
        threads = self.threads(p)
        minb = p.get("MINB", 1)
        if self.tma and bk * size != 128:
            out.append(f"BK={bk}: a k tile is one 128-byte swizzle row ({128 // size} "
                       f"elements of {dtype})")
        if self.wgmma:
            if bm % 64 or not 64 <= bm <= 256:
                out.append(f"BM={bm}: one consumer warpgroup per 64 rows, 1 to 4 of them")
            if bn not in (64, 128, 256):
                out.append(f"BN={bn}: wgmma's N is 64, 128 or 256 here")
            if bk % 16:
                out.append(f"BK={bk} is not a multiple of wgmma's k (16)")
            if p.get("INFLIGHT", 0) not in (0, 1):
                out.append(f"INFLIGHT={p['INFLIGHT']}: 0 or 1 wgmma group left running")
            if self.tma and bm > 128:
                out.append(f"BM={bm}: one or two consumer warpgroups (BM 64 or 128)")
            cap = min(255, 65536 // threads)
            if self.tma and bm == 128:  # setmaxnreg moves the producer's registers to them
                cap = 232
            if bn // 2 + 48 > cap:
                out.append(f"{bn // 2} accumulators a thread leave too few of the {cap} "
                           f"registers {threads} threads may use")
        else:
            wm, wn = p["WM"], p["WN"]
            if wm % 16 or wn % 16:  # ldmatrix.x4 loads the B fragments of 2 n tiles
                out.append(f"warp tile {wm}x{wn}: WM and WN multiples of 16")
            if bm % wm or bn % wn:
                out.append(f"block tile {bm}x{bn} is not a multiple of warp tile {wm}x{wn}")
            row = 128 // size  # shared rows are multiples of 128 bytes (the swizzle's span)
            if bm % row or bn % row or bk % row:
                out.append(f"BM, BN and BK must be multiples of {row} ({dtype}: 128-byte "
                           "shared-memory rows)")
            if not 64 <= threads <= 1024:
                out.append(f"{threads} threads per block (64..1024 allowed)")
            words = wm * wn // 32  # fp32 accumulators a thread
            cap = min(255, 65536 // (max(minb, 1) * max(threads, 1)))
            if self.tma and p.get("SYNC", 0) == 2:
                # setmaxnreg's 216 (below): ptxas fits a 64 x 64 warp tile's 128 in them
                if words > 128:
                    out.append(f"{words} accumulators a thread, more than the 128 of a 64 x 64 "
                               "warp tile that the computing warps' 216 registers hold")
            elif words > cap // 2 + 1:
                out.append(f"{words} accumulators a thread, more than half of the {cap} "
                           "registers a thread may use")
            if minb not in (1, 2, 3, 4):
                out.append("MINB (blocks per SM the register budget allows) must be 1..4, "
                           f"got {minb}")
            sync = p.get("SYNC", 0)
            if sync not in ((0, 1, 2) if self.tma else (0, 1)):
                also = " or 2 (a producer warpgroup)" if self.tma else ""
                out.append(f"SYNC={sync}: 0 (a block barrier hands stages back), 1 (an empty "
                           f"mbarrier a stage){also}")
            elif sync == 2:
                computing = threads - 128
                launch = min(255, 65536 // (max(minb, 1) * threads)) // 8 * 8
                if computing % 128:
                    out.append(f"SYNC=2: {computing // 32} computing warps, not whole warpgroups")
                # setmaxnreg (15_mma_tma.cu): the producer down to 40 registers, the
                # computing warps up to 216, from what the launch gives every thread
                elif not 40 <= launch <= 216 or 128 * 40 + computing * 216 > launch * threads:
                    out.append(f"SYNC=2: {threads} threads x {max(minb, 1)} blocks leave "
                               f"{launch} registers a thread, not room for 40 (producer) and "
                               "216 (computing warps)")
            if p.get("LOOP", 0) not in (0, 1):
                out.append(f"LOOP={p['LOOP']}: 0 (one fragment buffer) or 1 (two, the tile "
                           "boundary before the last k step)")
        if stages < 2:
            out.append("at least 2 pipeline stages")
        limit = MAX_SMEM_BYTES.get(cc, 99 * 1024)
        smem = self.smem_bytes(dtype, p)
        if smem > limit:
            out.append(f"{smem} bytes of shared memory (at most {limit} on sm_{cc})")
        elif minb > 1 and minb * smem > limit + 1024:
            out.append(f"{minb} blocks of {smem} bytes of shared memory do not fit one SM")
        return out

    def candidates(self, dtype: str, cc: int = 90) -> list[dict[str, int]]:
        """Every valid configuration of the tuning space for input ``dtype`` (defaults first)."""
        dtype = _tc_dtype(dtype)
        space = self.tune_space
        out = [self.params(dtype)]
        for blk, bk, warp, stages, minb, inflight, loop, sync in itertools.product(
                space["block"], space["BK"], space.get("warp", (None,)), space["STAGES"],
                space.get("MINB", (1,)), space.get("INFLIGHT", (None,)), space.get("LOOP", (None,)),
                space.get("SYNC", (None,))):
            p = {"BM": blk[0], "BN": blk[1], "BK": bk}
            if warp is not None:
                p.update(WM=warp[0], WN=warp[1])
            p["STAGES"] = stages
            if not self.wgmma:
                p["MINB"] = minb
            elif inflight is not None:
                p["INFLIGHT"] = inflight
            if loop is not None:
                p["LOOP"] = loop
            if sync is not None:
                p["SYNC"] = sync
            for key, value in self.defaults[dtype].items():  # settings outside the space
                p.setdefault(key, value)
            if p not in out and not self.violations(dtype, p, cc):
                out.append(p)
        return out

    def grid_dims(self, m: int, n: int, p: Mapping[str, int]) -> tuple[int, int, int]:
        bm, bn = self.tile(p)
        tiles = -(-m // bm) * -(-n // bn)
        if tiles >= 2**31:
            raise ValueError(f"{m}x{n} needs {tiles} blocks of {bm}x{bn}; at most 2^31 - 1")
        return tiles, 1, 1


def _tc_dtype(dtype) -> str:
    """The name of a tensor-core input dtype: "float32", "float16" or "bfloat16" (the last
    also from ``ml_dtypes.bfloat16`` or the string)."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        return dtype
    dt = np.dtype(dtype)
    return "bfloat16" if dt.name == "bfloat16" else dt.name


def _np_dtype(dtype) -> str:
    """A numpy dtype of the same size as the input format (bfloat16 travels as uint16)."""
    return "uint16" if _tc_dtype(dtype) == "bfloat16" else _tc_dtype(dtype)


_MMA_WARPS = ((64, 32), (32, 64), (64, 64), (32, 32))
_MMA_BLOCKS = ((128, 128), (128, 256), (256, 128), (128, 64), (64, 128), (64, 64))

TC_KERNELS: dict[str, TensorCoreSpec] = {k.name: k for k in (
    TensorCoreSpec(
        "mma_tf32", 11, "11_mma_tf32.cu",
        "TF32 tensor cores: mma.sync m16n8k8 on operands rounded before the launch, swizzled smem",
        "distmm_gemm_mma_tf32<{T},{BM},{BN},{BK},{WM},{WN},{STAGES},{MINB},{LOOP},{TA},{TB}>",
        precisions={"tf32": "float32"},
        defaults={"float32": {"BM": 128, "BN": 128, "BK": 32, "WM": 64, "WN": 64, "STAGES": 3,
                              "MINB": 1, "LOOP": 1}},
        tune_space={"block": _MMA_BLOCKS, "BK": (32, 64), "warp": _MMA_WARPS,
                    "STAGES": (2, 3, 4), "MINB": (1, 2), "LOOP": (0, 1)}),
    TensorCoreSpec(
        "mma_bf16", 12, "12_mma_bf16.cu",
        "BF16/FP16 tensor cores: mma.sync m16n8k16, ldmatrix(.trans), swizzled smem",
        "distmm_gemm_mma_bf16<{T},{BM},{BN},{BK},{WM},{WN},{STAGES},{MINB},{TA},{TB}>",
        precisions={"bf16": "bfloat16", "fp16": "float16"},
        defaults={dt: {"BM": 128, "BN": 128, "BK": 64, "WM": 64, "WN": 64, "STAGES": 3, "MINB": 1}
                  for dt in ("bfloat16", "float16")},
        tune_space={"block": _MMA_BLOCKS, "BK": (64, 128), "warp": _MMA_WARPS,
                    "STAGES": (2, 3, 4, 5), "MINB": (1, 2)}),
    TensorCoreSpec(
        "wgmma_bf16", 13, "13_wgmma_bf16.cu",
        "Hopper wgmma m64nNk16: warp-specialised producer/consumers, mbarriers (sm_90a)",
        "distmm_gemm_wgmma_bf16<{T},{BM},{BN},{BK},{STAGES},{INFLIGHT},{TA},{TB}>",
        precisions={"bf16": "bfloat16", "fp16": "float16"},
        defaults={dt: {"BM": 128, "BN": 128, "BK": 64, "STAGES": 4, "INFLIGHT": 0}
                  for dt in ("bfloat16", "float16")},
        tune_space={"block": ((128, 128), (64, 128), (64, 256), (128, 64), (192, 128), (256, 128)),
                    "BK": (32, 64), "STAGES": (3, 4, 5, 6), "INFLIGHT": (0, 1)},
        min_cc=90, max_cc=90, arch_suffix="a"),
    TensorCoreSpec(
        "wgmma_tma", 14, "14_wgmma_tma.cu",
        "Hopper wgmma fed by TMA: tensor maps, 128-byte swizzle, setmaxnreg (sm_90a)",
        "distmm_gemm_wgmma_tma<{T},{BM},{BN},{BK},{STAGES},{TA},{TB}>",
        precisions={"bf16": "bfloat16", "fp16": "float16", "tf32": "float32"},
        # a k tile is one 128-byte row: 64 16-bit elements, 32 TF32 values
        defaults={**{dt: {"BM": 128, "BN": 256, "BK": 64, "STAGES": 4}
                     for dt in ("bfloat16", "float16")},
                  "float32": {"BM": 128, "BN": 256, "BK": 32, "STAGES": 4}},
        tune_space={"block": ((128, 256), (128, 128), (64, 256), (64, 128)), "BK": (32, 64),
                    "STAGES": (3, 4, 5, 6)},
        min_cc=90, max_cc=90, arch_suffix="a", tma=True),
    TensorCoreSpec(
        "mma_tma", 15, "15_mma_tma.cu",
        "BF16/FP16 and TF32 mma.sync fed by TMA: step 12's warps, one thread queues the copies "
        "(sm_90)",
        "distmm_gemm_mma_tma<{T},{BM},{BN},{BK},{WM},{WN},{STAGES},{MINB},{SYNC},{TA},{TB}>",
        precisions={"bf16": "bfloat16", "fp16": "float16", "tf32": "float32"},
        # a k tile is one 128-byte row: 64 16-bit elements, 32 TF32 values; TF32 in blocks
        # of 256 x 128 (8 warps, one block an SM), bf16/fp16 in two blocks of 128 x 128
        defaults={**{dt: {"BM": 128, "BN": 128, "BK": 64, "WM": 64, "WN": 64, "STAGES": 3,
                          "MINB": 1, "SYNC": 0} for dt in ("bfloat16", "float16")},
                  "float32": {"BM": 256, "BN": 128, "BK": 32, "WM": 64, "WN": 64, "STAGES": 3,
                              "MINB": 1, "SYNC": 0}},
        tune_space={"block": _MMA_BLOCKS, "BK": (32, 64), "warp": _MMA_WARPS,
                    "STAGES": (2, 3, 4, 5), "MINB": (1, 2), "SYNC": (0, 1, 2)},
        # sm_90a: SYNC 2's setmaxnreg
        min_cc=90, max_cc=90, arch_suffix="a", tma=True),
)}

#: precision mode -> tensor-core kernels for it, preferred first (``kernel_for`` takes the
#: first that runs on the device)
PRECISION_KERNELS: dict[str, tuple[str, ...]] = {
    "tf32": ("wgmma_tma", "mma_tma", "mma_tf32"),
    "bf16": ("wgmma_tma", "wgmma_bf16", "mma_bf16"),
    "fp16": ("wgmma_tma", "wgmma_bf16", "mma_bf16"),
}


def get_tc(name: str) -> TensorCoreSpec:
    """The spec of tensor-core kernel ``name``; ``KeyError`` names the known ones."""
    try:
        return TC_KERNELS[name]
    except KeyError:
        raise KeyError(f"no tensor-core kernel {name!r}; known: {', '.join(TC_KERNELS)}") from None


def tc_steps() -> list[TensorCoreSpec]:
    """Tensor-core kernels in step order."""
    return sorted(TC_KERNELS.values(), key=lambda k: k.step)


def kernel_for(dtype, precision: str, cc: int) -> TensorCoreSpec | None:
    """The tensor-core kernel for a product in ``precision`` on compute capability ``cc``,
    or None (the caller then uses cuBLAS, or for ``"highest"`` ``best_kernel()``).

    Parameters
    ----------
    dtype : dtype
        The operands' dtype as the caller holds them: float32 for every mode (the loader
        rounds or converts), or the mode's own input format (bfloat16 for ``"bf16"``,
        float16 for ``"fp16"``).
    precision : {"highest", "tf32", "bf16", "fp16"}
    cc : int
        10 * major + minor (90 for H100 / H200).

    Returns
    -------
    TensorCoreSpec or None
        None for ``"highest"``, for dtypes the mode does not take, and where no kernel runs
        on ``cc`` (below 8.0). ``spec.precisions[precision]`` is the input format to launch
        with (``cuda_loader.launch_tc``).

    Examples
    --------
    >>> kernel_for("float32", "bf16", 90).name, kernel_for("float32", "bf16", 80).name
    ('wgmma_tma', 'mma_bf16')
    >>> kernel_for("float32", "tf32", 75) is None
    True
    """
    if precision not in PRECISION_KERNELS:
        return None
    held = _tc_dtype(dtype)
    if held not in ("float32", PRECISION_INPUT[precision]):
        return None
    for name in PRECISION_KERNELS[precision]:
        spec = TC_KERNELS[name]
        if spec.runs_on(cc):
            return spec
    return None
