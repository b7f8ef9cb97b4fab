"""What does the hot loop of a raw kernel execute? Its SASS instruction mix, from an nvcc cubin.

What it showed for step 8 (the loader's bounds arithmetic in the hot loop, hence the
bounds-free interior path) is in bench/NOTES.md, "GPU kernels, steps 1-8".

Compiles one instantiation (``--kernel``, default the registry's best; ``--dtype``; registry
default parameters; NN layout) with ``nvcc -Xptxas -v`` (register and spill report), disassembles
it with ``cuobjdump -sass`` and prints the instruction histogram of the whole kernel and of the
backward branch with the most FMAs (the k loop), then the loop's first 250 instructions. Needs
nvcc and cuobjdump, no GPU::

    python -m bench.research.sass_hot_loop --dtype float32 > sass.txt
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

CTYPES = {"float32": "float", "float64": "double", "int32": "int", "int64": "long long"}


def op(text: str) -> str:
    """The opcode of one SASS instruction (predicate guard dropped)."""
    text = re.sub(r"^@!?U?P\w+\s+", "", text)
    return text.split()[0] if text else "?"


def report(sass: str, fma: str) -> str:
    """Histogram of the whole kernel and of its hottest loop (the backward branch enclosing
    the most ``fma`` instructions)."""
    ins = []
    for ln in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    out = ["== instruction histogram (whole kernel)"]
    out += [f"{v:7d} {k}" for k, v in collections.Counter(op(t) for _, t in ins).most_common(25)]
    best = None
    for addr, t in ins:
        m = re.search(r"BRA\s+(?:`?\(?\.?L?_?x?_?)?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < addr:
            body = [x for a, x in ins if int(m.group(1), 16) <= a <= addr]
            n = sum(op(x) == fma for x in body)
            if best is None or n > best[0]:
                best = (n, int(m.group(1), 16), addr, body)
    if best:
        n, lo, hi, body = best
        out.append(f"== hot loop 0x{lo:x}..0x{hi:x}: {len(body)} instructions, {n} {fma} "
                   f"({100 * n / len(body):.1f}%)")
        out += [f"{v:7d} {k}" for k, v in collections.Counter(op(x) for x in body).most_common(25)]
        out.append("== hot loop listing (first 250)")
        out += body[:250]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.research.sass_hot_loop",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", default=None, help="registry name (default: the best kernel)")
    ap.add_argument("--dtype", default="float32", choices=sorted(CTYPES))
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args(argv)

    import distmm.executor.registry as registry
    from distmm.executor import cuda_loader

    spec = registry.get(args.kernel) if args.kernel else registry.best_kernel()
    params = spec.params(args.dtype)
    expr = spec.name_expression(args.dtype, params, False, False)
    ctype = CTYPES[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        # the same text the loader's nvcc path compiles
        cu.write_text(cuda_loader.source(spec.file) + cuda_loader.explicit_instantiation(expr, ctype))
        res = subprocess.run(["nvcc", "-std=c++17", "-DDISTMM_NVRTC", f"-arch={args.arch}", "-cubin",
                              "-Xptxas", "-v", "-o", str(cubin), str(cu)],
                             capture_output=True, text=True)
        print(res.stdout + res.stderr)
        if res.returncode:
            return 1
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
    print(f"{spec.name} {args.dtype} {params}")
    print(report(sass, "FFMA" if args.dtype == "float32" else "DFMA"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
