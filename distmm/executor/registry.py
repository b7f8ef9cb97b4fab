"""The one table of distmm's CUDA GEMM kernels.

This module covers: every kernel in ``kernels/cuda/`` (one optimisation step per file),
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
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

__all__ = ["KernelSpec", "KERNELS", "DTYPES", "C_TYPES", "get", "steps", "best_kernel",
           "kernel_params", "MAX_SMEM_BYTES", "PRECISION_KERNELS", "kernel_for"]

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


def kernel_params(spec: KernelSpec, dtype: str, tuned: Mapping[str, Any] | None = None) -> dict:
    """Parameters for ``spec`` and ``dtype``: a tuned configuration when it is valid, else
    the defaults."""
    if tuned and spec.tunable:
        try:
            p = spec.params(dtype, tuned)
        except (KeyError, TypeError, ValueError):
            return spec.params(dtype)
        if not spec.violations(dtype, p):
            return p
    return spec.params(dtype)


#: reduced precision mode (``distmm.precision``) -> names of tensor-core kernels for it,
#: fastest first (a kernel whose ``min_cc`` the device lacks is passed over). A kernel
#: listed here takes float32 A, B and C as ``cuda_loader.launch`` passes them, rounds A
#: and B to the mode's format as it loads them (round to nearest, ties to even, as
#: ``distmm.executor.reduced.round_to`` does) and accumulates in float32, so its result
#: is within ``distmm.precision.error_bound`` of the CPU emulation's. Names not (yet) in
#: ``KERNELS`` are skipped, and a mode without a kernel runs on cuBLAS
#: (``distmm.executor.cublas.cublas_gemm_precision``).
PRECISION_KERNELS: dict[str, tuple[str, ...]] = {
    "tf32": ("mma_tf32",),  # kernels/cuda/11_mma_tf32.cu
    "bf16": ("wgmma_bf16", "mma_bf16"),  # 13_wgmma_bf16.cu (sm_90), 12_mma_bf16.cu (sm_80)
    "fp16": (),  # cuBLAS
}


def kernel_for(dtype, precision: str, cc: int) -> KernelSpec | None:
    """The fastest registered kernel for a product of accumulation dtype ``dtype`` in
    ``precision`` on a device of compute capability ``cc`` (10 * major + minor), or None
    when there is none (the caller then uses cuBLAS). ``"highest"`` and dtypes other than
    float32 have none here: their kernels are ``best_kernel()``'s."""
    if precision == "highest" or np.dtype(dtype).name != "float32":
        return None
    for name in PRECISION_KERNELS.get(precision, ()):
        spec = KERNELS.get(name)
        if spec is not None and cc >= spec.min_cc:
            return spec
    return None
