#!/usr/bin/env python3
"""Resolve splat-metal's Mac install (Apple Silicon) with pip's own resolver, from any machine.

For each supported Python and macOS 13 and 14 on arm64 this asks pip what
`pip install --only-binary=:all: -e ".[test]"` would install on that Mac, writes the pins to
constraints-macos-arm64.txt (what scripts/setup.sh installs a Mac with), resolves once more with
only that file (setup.sh's own command) and prints what each target gets.

pip's --platform/--python-version/--abi choose wheel tags only; environment markers
(`platform_machine == "arm64"`, `sys_platform == "darwin"`, `python_version`) would still be
evaluated for the machine pip runs on. So pip runs in a child process whose
`packaging.markers.default_environment` returns a Mac's values (MARKER_CHILD), and the script checks
that pip's report echoes them. No pip configuration file or PIP_* variable of this machine is used
(local mirrors, caps on torch): the package index is pip's default, as on a user's Mac.

    python scripts/resolve_macos.py           # refresh constraints-macos-arm64.txt, verify, report
    python scripts/resolve_macos.py --check   # verify the committed file only (exit 1 if it fails)

Needs the package index and pip >= 23.1 (it reads wheel metadata, downloads few wheels):
about a minute per target.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints-macos-arm64.txt"
PYTHONS = ("3.10", "3.11", "3.12")  # = pyproject.toml's requires-python
MACOS = (13, 14)  # oldest supported first; later macOS releases take macOS 14's wheels
DARWIN = {13: 22, 14: 23}  # the Darwin kernel major version each macOS reports as platform_release
SELF = "splat-metal-method"
# Where Linux's torch has no wheels (macOS 13: torch >= 2.12 needs macOS 14): torch.mps.compile_shader
# is public from 2.7, and 2.9-2.11 always compile MSL 3.1, which macOS 13 lacks (docs/design.md section 3.1).
TORCH_FALLBACK = "torch>=2.7,<2.9"
TORCH_FALLBACK_WHY = "compile_shader is public from 2.7; 2.9-2.11 compile MSL 3.1, which macOS 13 lacks"
SHOWN = ("torch", "torchvision", "numpy", "av", "fpsample", "rawpy", "open3d")

# Runs pip with packaging's marker environment replaced by the JSON in argv[1] (before pip imports
# anything from packaging by name, so pip's report's "environment" shows it too).
MARKER_CHILD = """
import json, sys
from pip._vendor.packaging import markers
env = json.loads(sys.argv[1])
markers.default_environment = lambda: dict(env)
from pip._internal.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def mac_environment(python: str, macos: int) -> dict[str, str]:
    """PEP 508 marker values of CPython `python` on an arm64 Mac running `macos`."""
    darwin = f"{DARWIN[macos]}.6.0"
    return {
        "implementation_name": "cpython",
        "implementation_version": f"{python}.0",
        "os_name": "posix",
        "platform_machine": "arm64",
        "platform_python_implementation": "CPython",
        "platform_release": darwin,
        "platform_system": "Darwin",
        "platform_version": f"Darwin Kernel Version {darwin}: RELEASE_ARM64",
        "python_full_version": f"{python}.0",
        "python_version": python,
        "sys_platform": "darwin",
    }


def pip_environ() -> dict[str, str]:
    """This process's environment without pip configuration (files and PIP_* variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT")}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip then reads no configuration file at all
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def pip_resolve(python: str, macos: int, *requirements: str, pip_args: tuple[str, ...] = ()) -> dict:
    """pip's --dry-run report of installing `requirements` (run in ROOT) on that Mac, wheels only.

    Raises RuntimeError with pip's last lines of output when pip cannot resolve.
    """
    nodot = python.replace(".", "")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable,
            "-c",
            MARKER_CHILD,
            json.dumps(mac_environment(python, macos)),
            "install",
            "--dry-run",
            "--quiet",
            "--report",
            str(report),
            "--ignore-installed",
            "--only-binary=:all:",
            "--platform",
            f"macosx_{macos}_0_arm64",
            "--python-version",
            python,
            "--implementation",
            "cp",
            "--abi",
            f"cp{nodot}",
            *pip_args,
            *requirements,
        ]
        proc = subprocess.run(cmd, cwd=ROOT, env=pip_environ(), capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
            raise RuntimeError("\n".join(lines[-12:]))
        data = json.loads(report.read_text())
    if data["environment"]["platform_machine"] != "arm64" or data["environment"]["python_version"] != python:
        raise RuntimeError(f"pip did not use the Mac's marker environment: {data['environment']}")
    return data


def installed(report: dict) -> dict[str, str]:
    """{name: version} of what a pip report would install, without this project itself."""
    versions = {item["metadata"]["name"]: item["metadata"]["version"] for item in report["install"]}
    versions.pop(SELF, None)
    return versions


def linux_torch() -> list[str]:
    """The torch/torchvision pins scripts/setup.sh installs on Linux x86_64 (the tested ones)."""
    match = re.search(r'Linux-x86_64\) torch_pkgs="([^"]+)"', (ROOT / "scripts" / "setup.sh").read_text())
    if match is None:
        raise SystemExit("scripts/setup.sh: no Linux-x86_64 torch_pkgs=... line to take the torch pins from")
    return match.group(1).split()


def resolve_target(python: str, macos: int, torch_pins: list[str]) -> tuple[dict[str, str], str]:
    """What a fresh wheels-only install of `.[test]` gets on that Mac: with Linux's torch if it has
    wheels there, else with the newest torch whose Metal kernels can build there (TORCH_FALLBACK)."""
    try:
        return installed(pip_resolve(python, macos, "-e", ".[test]", *torch_pins)), ""
    except RuntimeError as error:
        why = str(error).splitlines()[-1].removeprefix("ERROR: ").strip()
        note = f"{why}; took {TORCH_FALLBACK} ({TORCH_FALLBACK_WHY})"
    return installed(pip_resolve(python, macos, "-e", ".[test]", TORCH_FALLBACK)), note


def marker_of(group: set[tuple[str, int]], targets: list[tuple[str, int]]) -> str:
    """A PEP 508 marker true on exactly the targets in `group` (of `targets`); "" for all of them."""
    if group == set(targets):
        return ""
    pythons = sorted({p for p, _ in targets})
    macs = sorted({m for _, m in targets})

    def on_macos(ms: list[int]) -> str:
        if ms == macs:
            return ""
        terms = []
        for m in ms:  # macOS m <=> platform_release in [DARWIN[m], DARWIN[next]) (open-ended for the last)
            i = macs.index(m)
            bounds = ([f'platform_release >= "{DARWIN[m]}"'] if i > 0 else []) + (
                [f'platform_release < "{DARWIN[macs[i + 1]]}"'] if i + 1 < len(macs) else []
            )
            terms.append(" and ".join(bounds))
        return " or ".join(f"({t})" if len(terms) > 1 and " and " in t else t for t in terms)

    macs_of = {p: sorted(m for q, m in group if q == p) for p in pythons if any(q == p for q, _ in group)}
    if len(macs_of) == len(pythons) and len({tuple(ms) for ms in macs_of.values()}) == 1:
        return on_macos(next(iter(macs_of.values())))  # the same macOS versions on every Python
    terms = []
    for p, ms in macs_of.items():
        mac = on_macos(ms)
        terms.append(f'python_version == "{p}"' + (f" and ({mac})" if " or " in mac else f" and {mac}" if mac else ""))
    return " or ".join(f"({t})" if len(terms) > 1 and " and " in t else t for t in terms)


def constraint_lines(resolved: dict[tuple[str, int], dict[str, str]]) -> list[str]:
    """Pins for every package any target installs; a package whose version differs between targets
    gets one line per version, with a marker selecting the targets it belongs to."""
    targets = list(resolved)
    names = sorted({n for versions in resolved.values() for n in versions}, key=str.lower)
    lines = []
    for name in names:
        by_version: dict[str, set[tuple[str, int]]] = {}
        for target, versions in resolved.items():
            if name in versions:
                by_version.setdefault(versions[name], set()).add(target)
        if len(by_version) == 1:  # one version wherever it is installed: no marker needed
            lines.append(f"{name}=={next(iter(by_version))}")
            continue
        for version, group in sorted(by_version.items(), key=lambda kv: min(kv[1])):
            lines.append(f"{name}=={version}; {marker_of(group, targets)}")
    return lines


def write_constraints(
    resolved: dict[tuple[str, int], dict[str, str]], notes: dict[tuple[str, int], str], torch_pins: list[str]
) -> None:
    import pip

    header = [
        f"# GENERATED by `python scripts/resolve_macos.py` ({datetime.date.today()}, pip {pip.__version__}):"
        " do not edit, re-run it.",
        "# What scripts/setup.sh installs on Apple Silicon, wheels only: pip's resolver with an arm64 Mac's",
        f"# marker values and wheel tags for Python {', '.join(PYTHONS)} on macOS {' and '.join(map(str, MACOS))},"
        f" resolving `-e .[test]`",
        f"# with Linux's {' '.join(torch_pins)} where they have wheels. platform_release is the Darwin version:",
        "# " + ", ".join(f"{DARWIN[m]} = macOS {m}" for m in MACOS) + f" (later macOS take macOS {MACOS[-1]}'s pins).",
    ]
    for note in sorted(set(notes.values()) - {""}):
        where = [
            f"Python {'/'.join(p for p, m2 in notes if m2 == m and notes[(p, m2)] == note)} on macOS {m}"
            for m in MACOS
            if any(notes[(p, m)] == note for p in PYTHONS)
        ]
        header.append(f"# {', '.join(where)}: {note}")
    CONSTRAINTS.write_text("\n".join(header + constraint_lines(resolved)) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only verify the committed constraints file")
    parser.add_argument("--jobs", type=int, default=3, help="resolutions run at once (default 3)")
    args = parser.parse_args()
    targets = [(p, m) for p in PYTHONS for m in MACOS]
    pool = concurrent.futures.ThreadPoolExecutor(args.jobs)

    fresh: dict[tuple[str, int], dict[str, str]] = {}
    if not args.check:
        torch_pins = linux_torch()
        print(f"[resolve] {len(targets)} targets, wheels only, torch pins to try: {' '.join(torch_pins)}", flush=True)
        jobs = {t: pool.submit(resolve_target, *t, torch_pins) for t in targets}
        notes = {}
        for t, job in jobs.items():
            try:
                fresh[t], notes[t] = job.result()
            except RuntimeError as error:
                print(f"[resolve] Python {t[0]}, macOS {t[1]}: FAILED\n{error}", file=sys.stderr)
        if len(fresh) < len(targets):
            return 1
        write_constraints(fresh, notes, torch_pins)
        print(f"[resolve] wrote {CONSTRAINTS.name}", flush=True)

    # What setup.sh runs on a Mac: only the constraints file, wheels only.
    pinned = (str(CONSTRAINTS.relative_to(ROOT)),)
    jobs = {t: pool.submit(pip_resolve, *t, "-e", ".[test]", pip_args=("-c", *pinned)) for t in targets}
    failed = 0
    print(f"\n{'Python':6} {'macOS':5} {'packages':8} " + " ".join(f"{n:12}" for n in SHOWN) + " result")
    for (p, m), job in jobs.items():
        try:
            got, result = installed(job.result()), "ok"
        except RuntimeError as error:
            got, result = {}, "FAILED: " + str(error).splitlines()[-1].strip()
        if fresh and got and got != fresh[(p, m)]:
            diff = sorted(set(got.items()) ^ set(fresh[(p, m)].items()))
            result = f"FAILED: constrained resolution differs: {diff[:6]}"
        failed += result != "ok"
        print(f"{p:6} {m:<5} {len(got):<8} " + " ".join(f"{got.get(n, '-'):12}" for n in SHOWN) + f" {result}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
