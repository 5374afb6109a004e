"""Regenerate the figures every lab sheet embeds: `python experiments/figures.py [LAB ...] [--jobs 2]`.

Each lab runs at its quick size (`jaxpar lab NAME --quick --out TMP`), longest first and at most --jobs at a
time (the machine may be shared); the PNGs a sheet shows are copied into experiments/NN_name/figures/ beside
figures.json, the run's record: date, machine (architecture, cores, CPU model), load average at the start and
end, jaxpar's git commit, the command, its wall and CPU seconds. A lab that fails leaves its old figures as
they were and makes the exit status 1.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# lab -> (sheet folder, the PNGs its sheet shows), longest quick run first (CPU-seconds measured on 2 cores)
FIGURES = {
    "pipeline": ("04_pipeline", ["tables.png", "timeline.png", "memory.png"]),
    "capstone": ("10_capstone", ["plan.png", "memory.png", "cpu_check.png"]),
    "moe": ("07_moe", ["communication.png", "balance.png", "capacity.png"]),
    "overlap": ("05_overlap", ["timeline.png"]),
    "tensor": ("03_tensor", ["equivalence.png", "communication.png", "memory.png"]),
    "kernels": ("08_kernels", ["memory.png", "compile.png"]),
    "operations": ("09_operations", ["goodput_timeline.png"]),
    "pytorch": ("06_pytorch", ["losses.png", "bytes.png"]),
    "zero": ("02_zero", ["equivalence.png", "memory.png", "communication.png"]),
    "dryrun": ("00_dryrun", ["memory.png"]),
    "collectives": ("01_collectives", ["collectives.png"]),
}
MAX_BYTES = 150_000          # a committed PNG above this is re-encoded with a 256-colour palette


def machine() -> dict:
    """The machine the figures come from: architecture, cores, CPU model."""
    model = platform.processor()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"arch": platform.machine(), "cores": os.cpu_count(), "cpu": model}


def commit() -> str:
    """jaxpar's git commit, with `+dirty` when jaxpar/ has uncommitted changes."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "jaxpar"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")


def load() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded."""
    return [round(x, 2) for x in os.getloadavg()]


def run_lab(name: str, tmp: Path) -> dict:
    """Run one lab at its quick size into tmp/name; its record (rc, wall and CPU seconds of it and its children)."""
    out = tmp / name
    cmd = [sys.executable, "-m", "jaxpar.cli", "lab", name, "--quick", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    log = (tmp / f"{name}.log").open("w")
    record = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "load_start": load()}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    log.close()
    record.update(wall_s=round(time.monotonic() - start, 1), cpu_s=round(usage.ru_utime + usage.ru_stime, 1),
                  load_end=load(), rc=proc.returncode, command=f"jaxpar lab {name} --quick")
    return record


def keep(name: str, record: dict, tmp: Path) -> list[str]:
    """Copy the lab's chosen PNGs into its sheet's figures/ (small) and write figures.json; the missing ones."""
    folder, pngs = FIGURES[name]
    dest = ROOT / "experiments" / folder / "figures"
    dest.mkdir(exist_ok=True)
    missing = [p for p in pngs if not (tmp / name / p).exists()]
    for png in pngs:
        if png not in missing:
            shutil.copyfile(tmp / name / png, dest / png)
            if (dest / png).stat().st_size > MAX_BYTES:
                shrink(dest / png)
    info = {**record, "machine": machine(), "commit": commit(), "figures": [p for p in pngs if p not in missing],
            "regenerate": f"python experiments/figures.py {name}"}
    (dest / "figures.json").write_text(json.dumps(info, indent=1) + "\n")
    return missing


def shrink(path: Path) -> None:
    """Re-encode a PNG with a 256-colour palette (plots have few colours; Pillow comes with matplotlib)."""
    from PIL import Image
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=256)
    small.save(path, optimize=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("labs", nargs="*", metavar="LAB", help=f"labs to run (default all: {' '.join(FIGURES)})")
    p.add_argument("--jobs", type=int, default=2, help="labs run at once (default 2)")
    args = p.parse_args(argv)
    unknown = [lab for lab in args.labs if lab not in FIGURES]
    if unknown or args.jobs < 1:
        print(f"figures.py: unknown lab {unknown} (valid: {', '.join(FIGURES)})" if unknown
              else "figures.py: --jobs must be at least 1", file=sys.stderr)
        return 2
    labs = [lab for lab in FIGURES if lab in (args.labs or FIGURES)]
    failed = False
    with tempfile.TemporaryDirectory(prefix="jaxpar-figures-") as tmp_name, ThreadPoolExecutor(args.jobs) as pool:
        tmp = Path(tmp_name)
        for name, record in zip(labs, pool.map(lambda lab: run_lab(lab, tmp), labs)):
            if record["rc"] != 0:
                failed = True
                tail = (tmp / f"{name}.log").read_text().splitlines()[-30:]
                print(f"{name}: FAILED (exit {record['rc']}); its output ends:", *tail, sep="\n", file=sys.stderr)
                continue
            missing = keep(name, record, tmp)
            failed |= bool(missing)
            print(f"{name}: {record['wall_s']} s wall, {record['cpu_s']} CPU-s, load {record['load_start'][0]} -> "
                  f"{record['load_end'][0]}" + (f"; MISSING {missing}" if missing else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
