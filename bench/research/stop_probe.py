"""Where does a `distmm matmul --resume` spend the time between its SIGTERM and its exit?

Runs the command (one process) on an n^2 float32 pair of ``.npy`` files it makes once in
``--work``; ``--at`` seconds after the start sends SIGTERM, then every 0.25 s prints which
threads have SIGTERM blocked (B), pending (P, S: shared) or caught (C), from
``/proc/<pid>/task/*/status``, and once, 0.6 s after the signal, sends SIGUSR1, on which
faulthandler prints every thread's Python stack to the command's stderr (printed at the end).
Arguments after ``--`` go to ``distmm matmul``. No record.

``python -m bench.research.stop_probe --n 57344 --at 7``
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import numpy as np

BIT = 1 << (signal.SIGTERM - 1)


def _make(work: str, n: int):
    os.makedirs(work, exist_ok=True)
    a, b, c = (os.path.join(work, f"{x}.npy") for x in "abc")
    if not os.path.exists(a):
        rng = np.random.default_rng(1)
        for path in (a, b):
            m = np.lib.format.open_memmap(path, "w+", np.float32, (n, n))
            for r in range(0, n, 4096):
                m[r:r + 4096] = rng.standard_normal((min(4096, n - r), n), dtype=np.float32)
            m.flush()
            del m
    for f in os.listdir(work):
        if f.startswith(".c") or f == "c.npy":
            os.remove(os.path.join(work, f))
    return a, b, c


def _masks(pid: int) -> list[str]:
    out = []
    try:
        tasks = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError:
        return out
    for tid in tasks:
        try:
            text = open(f"/proc/{pid}/task/{tid}/status").read()
        except OSError:
            continue
        f = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
        flags = "".join(letter if int(f[key].strip(), 16) & BIT else "-"
                        for key, letter in (("SigBlk", "B"), ("SigPnd", "P"), ("ShdPnd", "S"),
                                            ("SigCgt", "C")))
        out.append(f"{tid}:{f.get('Name', '?').strip()}:{flags}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.research.stop_probe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=32768)
    p.add_argument("--at", type=float, default=3.0, help="seconds from the start to SIGTERM")
    p.add_argument("--work", default="/tmp/distmm-stop-probe")
    p.add_argument("extra", nargs="*", help="arguments for distmm matmul (after --)")
    args = p.parse_args(argv)
    a, b, c = _make(args.work, args.n)
    os.sync()
    code = ("import faulthandler, signal, sys; "
            "faulthandler.register(signal.SIGUSR1, all_threads=True); "
            "from distmm.cli.commands import main; sys.exit(main(sys.argv[1:]))")
    cmd = [sys.executable, "-c", code, "matmul", a, b, "-o", c, "--resume", *args.extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        proc.wait(timeout=args.at)
        print("finished before the signal")
    except subprocess.TimeoutExpired:
        print("threads (B blocked, P pending, S shared pending, C caught):",
              " ".join(_masks(proc.pid)))
        sent = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        dumped = False
        while proc.poll() is None:
            time.sleep(0.25)
            waited = time.perf_counter() - sent
            held = [m for m in _masks(proc.pid) if set(m.rsplit(":", 1)[-1]) & set("BPS")]
            print(f"+{waited:.2f} s:", " ".join(held)[:600])
            if not dumped and waited > 0.6:
                proc.send_signal(signal.SIGUSR1)
                dumped = True
            if waited > 60:
                proc.kill()
        print(f"exit {proc.returncode} {time.perf_counter() - sent:.2f} s after SIGTERM")
    print(proc.stderr.read()[-12000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
