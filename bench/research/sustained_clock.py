"""At what SM clock and power does each tensor-core kernel run when it runs alone for a second, and what does mma.sync reach on registers at that clock?

``mma_ceiling.py`` timed mma.sync on registers in bursts of 0.1-0.9 ms, on operands whose
bits are mostly zero; a GEMM runs for milliseconds on random values. Hopper lowers its SM
clock when the board reaches its power limit, and the power a tensor-core instruction draws
grows with the bits it toggles. So the instruction ceiling the issue's 0.70 was weighed
against may not hold for a whole GEMM. Here each workload runs back to back for
``--seconds`` while ``nvidia-smi`` samples the SM clock, the board power and the active
clock-event reasons every 50 ms:

- cuBLAS (``cublasGemmEx``) at ``--size``^3, and distmm's steps 14 (wgmma) and 15 (mma.sync)
  with their defaults, on standard-normal operands rounded to the input format;
- step 15 with each ``--variant`` of its parameters;
- the register-only mma.sync loop of ``mma_ceiling.py`` (16 chains, 4 warps a block, 2
  blocks an SM, its best shape), on its near-zero operands and on random ones (random signs
  and significands, exponents of 0.5-1).

Every workload runs once per ``--repeat`` round, in the same order each round. Records
(``kernels-sustained-<device>-<date>.jsonl``, benchmark ``kernels-sustained``): per workload
the median over the rounds of its seconds a launch, clock and power, with
``ratio_vs_cublas``, the same run's cuBLAS median over the workload's.

``python -m bench.research.sustained_clock [--precisions bf16 tf32] [--seconds 1.5]
[--repeat 3] [--variant BM=256,STAGES=4] [--out-dir DIR]``
"""
from __future__ import annotations

import statistics
import subprocess
import time

import numpy as np

from bench.research.mma_ceiling import INSTRUCTIONS, ceiling_kernel, square_operands

_QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"

# the register-only loop with random operand bits: signs and significands random, the
# exponent that of 0.5 .. 1 (bf16/fp16 halves: 0x3f00 / 0x3800; TF32 as float32: 0x3f000000)
_RANDOM_BITS = {"bf16": (0x807F807F, 0x3F003F00), "fp16": (0x83FF83FF, 0x38003800),
                "tf32": (0x807FE000, 0x3F000000)}


def _sampled(run, seconds: float) -> dict:
    """``run()`` back to back for about ``seconds`` while nvidia-smi samples the clock and
    power; the rate over the whole window and the medians of the middle 60% of samples."""
    import cupy

    run()
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    run()
    cupy.cuda.Device().synchronize()
    once = time.perf_counter() - t0
    count = max(3, int(seconds / max(once, 1e-6)))
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    time.sleep(0.2)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(count):
        run()
    end.record()
    end.synchronize()
    time.sleep(0.1)
    smi.terminate()
    out = smi.communicate()[0].splitlines()
    rows = []
    for line in out:
        parts = [p.strip() for p in line.split(",")]
        try:
            rows.append((float(parts[0]), float(parts[1]), parts[2]))
        except (ValueError, IndexError):
            continue
    mid = rows[len(rows) // 5: max(len(rows) * 4 // 5, len(rows) // 5 + 1)] or rows
    return {"seconds": cupy.cuda.get_elapsed_time(start, end) / 1e3 / count, "count": count,
            "clock_mhz": statistics.median(r[0] for r in mid) if mid else float("nan"),
            "power_w": statistics.median(r[1] for r in mid) if mid else float("nan"),
            "reasons": sorted({r[2] for r in mid}), "samples": len(rows)}


def main(argv=None) -> int:
    from bench.common import RecordWriter, parser

    p = parser(__doc__)
    p.add_argument("--repeat", type=int, default=3, help="rounds over the workloads")
    p.add_argument("--precisions", nargs="+", default=["bf16", "tf32"], choices=list(INSTRUCTIONS))
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--variant", action="append", default=[], metavar="KEY=INT[,KEY=INT]",
                   help="step 15 also with these parameters (bench.kernels --tc-variant)")
    args = p.parse_args(argv)

    import cupy

    from bench.kernels import cublas_precision_runner, parse_variant
    from distmm.executor import cuda_loader, registry

    dev = cupy.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    print(f"{name}: {sms} SMs, max clock {dev.attributes['ClockRate'] / 1e3:.0f} MHz; "
          f"each workload alone for {args.seconds} s", flush=True)
    n = args.size
    rec = RecordWriter("kernels-sustained", name, args.out_dir, gpus=1)
    print(f"records -> {rec.path}", flush=True)
    for precision in args.precisions:
        fmt = registry.PRECISION_INPUT[precision]
        a_in, b_in, c = square_operands(n, precision)
        gemm = 2.0 * n ** 3
        # label -> (run, flops a launch, record fields)
        runs = {f"cublas-{precision}": (cublas_precision_runner(a_in, b_in, c, n, n, n, precision),
                                        gemm, {"step": 0})}
        cc = int(dev.compute_capability)
        for step in ("wgmma_tma", "mma_tma"):
            spec = registry.get_tc(step)
            if precision in spec.precisions and spec.runs_on(cc):
                for text in [""] + (args.variant if step == "mma_tma" else []):
                    params = dict(spec.params(fmt), **(parse_variant(text) if text else {}))
                    if spec.violations(fmt, params, cc):
                        continue
                    runs[f"distmm-raw-{step}{'+' + text if text else ''}"] = (
                        (lambda s=step, q=params: cuda_loader.launch_tc(
                            s, a_in, False, n, b_in, False, n, c, n, n, n, n, precision=precision,
                            params=q)), gemm,
                        {"step": spec.step, "kernel": step, "params": params, "backend": "raw"})
        chains, warps, per_sm = 16, 4, 2
        blocks = sms * per_sm
        flops_mma = INSTRUCTIONS[precision][3]
        iters = 16384
        out = cupy.empty(blocks * warps * 32, dtype=np.float32)
        for operands in ("near-zero", "random"):
            kern = ceiling_kernel(precision, chains,
                                  _RANDOM_BITS[precision] if operands == "random" else None)
            flops = blocks * warps * iters * chains * flops_mma
            runs[f"ceiling-mma.sync-registers-{operands}"] = (
                (lambda k=kern: k((blocks,), (warps * 32,), (out, np.int32(iters), np.uint32(1)))),
                flops, {"chains": chains, "warps_per_block": warps, "blocks_per_sm": per_sm,
                        "flops_per_launch": flops})
        got = {label: [] for label in runs}
        for round_ in range(args.repeat):
            for label, (run, flops, _) in runs.items():
                r = _sampled(run, args.seconds)
                got[label].append(r)
                print(f"{precision} round {round_} {label:44s} {flops / r['seconds'] / 1e12:7.1f} "
                      f"TFLOP/s  clock {r['clock_mhz']:6.0f} MHz  power {r['power_w']:5.0f} W  "
                      f"reasons {','.join(r['reasons'])}  ({r['count']} launches)", flush=True)
        ref = statistics.median(r["seconds"] for r in got[f"cublas-{precision}"])
        for label, (run, flops, fields) in runs.items():
            rs = got[label]
            # a ceiling's seconds scaled to the n^3 product's flops, so that the record's
            # tflops are the probe's (seconds_launch: one launch)
            scale = gemm / flops
            sec = statistics.median(r["seconds"] for r in rs) * scale
            extra = {} if flops == gemm else {"seconds_launch": sec / scale,
                                              "times_launch": [r["seconds"] for r in rs]}
            rec.add(label, "float32", n, n, n, sec, None, precision=precision, input_format=fmt,
                    times=[r["seconds"] * scale for r in rs], **extra,
                    clock_mhz=statistics.median(r["clock_mhz"] for r in rs),
                    power_w=statistics.median(r["power_w"] for r in rs),
                    clock_reasons=sorted({x for r in rs for x in r["reasons"]}),
                    launches=[r["count"] for r in rs], seconds_alone=args.seconds,
                    rounds=args.repeat, **fields,
                    **({"ratio_vs_cublas": ref / sec} if flops == gemm else {}),
                    note="each workload alone, back to back for seconds_alone, once a round; "
                         "median over the rounds; clock and power: nvidia-smi every 50 ms, "
                         "median of the middle 60% of samples; relerr not checked here "
                         "(bench.kernels checks the same kernels)" + (
                             "" if flops == gemm else "; a ceiling's seconds are its launches' "
                             "scaled to the m x n x k product's flops (seconds_launch: a launch)"))
            print(f"{precision} {label:44s} median {gemm / sec / 1e12:7.1f} TFLOP/s"
                  + (f" = {ref / sec:.3f} of cuBLAS" if flops == gemm else ""), flush=True)
        runs.clear()  # the operands go with the workloads that hold them
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
