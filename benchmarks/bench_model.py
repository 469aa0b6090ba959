"""The calibrated step model (a MODEL, not a measurement: benchmarks/step_model/peers.py): its
constants, how well it reproduces each published Apple-GPU measurement of msplat, the Plinth-it fork and
OpenSplat, the peers' design choices, and our step against msplat's on the same scenes, from step ledgers.

    python benchmarks/bench_model.py                            # stored ledgers (before issue 30); ~1 s
    python benchmarks/bench_model.py --after after.json         # adds the rows of newer ledgers
    python benchmarks/bench_model.py --write-ledger after.json  # measure this tree's ledgers first (minutes)
    python benchmarks/bench_model.py --refit                    # refit the constants (else the stored fit)
    python benchmarks/bench_model.py --write-ledger after.json --phases steady post_refine  # + the step after refine stop

--write-ledger runs benchmarks/bench_ledger.py's two scenes (the demo 96x64 and, where garden_points.npz
is found, garden-points 20k at 1/4) under the MSL emulator and writes their steady-step ledgers as JSON; with
--phases, also other phases of the step ledger, labelled "<scene> <phase>" (post_refine: a steady step after
refine stop, which computes no densification statistics). The tables below read the steady ledgers; the other
phases get their own rows ("after, <phase>").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from step_model import ledger, peers, results  # noqa: E402

PHASES = ("steady", "post_refine")  # of the step ledger, that --write-ledger measures


def write_ledgers(path: Path, phases=("steady",)) -> dict:
    from splat_metal_method.bench import scenes as bench_scenes

    work = Path(tempfile.mkdtemp(prefix="bench_model_"))
    data = {"demo 96x64": lambda: bench_scenes.demo(work / "demo", 96, 64),
            "garden-points 20k 1/4": lambda: bench_scenes.garden_points(work / "garden", 20_000, 4)}  # fmt: skip
    out = {}
    for label, make in data.items():
        try:
            scene = make()
        except FileNotFoundError as e:
            print(f"skipping {label}: {e}", flush=True)
            continue
        leds = ledger.measure(scene, "splat-metal", "metal", work / "outputs", phases=tuple(phases))
        for phase, led in leds.items():
            key = label if phase == "steady" else f"{label} {phase}"
            out[key] = peers.ledger_dict(led)
            print(f"measured {key}: {led.summary()}", flush=True)
    path.write_text(json.dumps(out, indent=1))
    return out


def by_phase(ledgers: dict) -> dict:
    """{phase: {scene label: ledger}} of --write-ledger's JSON, "steady" first: a ledger written with --phases is
    keyed "<scene> <phase>" and its "label" is the phase; any other (older files' labels name the scene) is steady."""
    out = {"steady": {}}
    for key, led in ledgers.items():
        phase = led.get("label")
        if phase in PHASES and phase != "steady" and key.endswith(f" {phase}"):
            out.setdefault(phase, {})[key[: -len(phase) - 1]] = led
        else:
            out["steady"][key] = led
    return {k: v for k, v in out.items() if v}


def report(after: dict | None, calib: peers.Calib, rms: float, after_label: str = "after") -> str:
    runs = {"before": results.before_issue30()}
    for phase, ledgers in by_phase(after or {}).items():  # the steady ledgers first
        runs[after_label if phase == "steady" else f"{after_label}, {phase}"] = ledgers
    parts = [
        "MODEL, not a measurement (benchmarks/step_model/peers.py); `python benchmarks/bench_model.py`",
        "",
        "### Constants",
        "",
        peers.constants_table(calib),
        "",
        f"### Calibration: modeled / measured per point (fit: least squares of log ratios, RMS {rms:.3f})",
        "",
        peers.calibration_table(calib),
        "",
        "### Peers' design choices in the model",
        "",
        peers.design_table(calib),
        "",
        "### Ours / msplat, steady step on an M4 Max (goal: at most 1.0 at every point)",
        "",
        peers.compare_table(runs, calib),
    ]
    for when, ledgers in runs.items():
        parts += ["", f"### Sensitivity of ours / msplat ({when}): one assumption changed at a time", "",
                  peers.sensitivity(ledgers, calib)]  # fmt: skip
    if not after:
        parts += ["", "after: not given (`--after FILE.json`, made by `--write-ledger FILE.json` on the new tree)"]
    for when, ledgers in runs.items():
        label = "garden-points 20k 1/4" if "garden-points 20k 1/4" in ledgers else next(iter(ledgers))
        parts += ["", f"### Where cutting pays ({when}, ours from the {label} ledger): modeled ms", ""]
        scenes = peers.COMPARE_SCENES
        rates = peers.aten_rates(ledgers)
        levers = [peers.ours_levers(ledgers[label], s, calib, rates) for s in scenes]
        parts.append("| change | " + " | ".join(s.name for s in scenes) + " |")
        parts.append("|---|" + "---|" * len(scenes))
        for k in levers[0]:
            parts.append(f"| {k} | " + " | ".join(f"{lv[k]:.1f}" for lv in levers) + " |")
        ours = peers.OursFromLedger(peers.ledger_dict(ledgers[label]), rates=rates)
        b = [ours.step(s, "M4 Max", calib) for s in scenes]
        parts += ["", "| our term | " + " | ".join(s.name for s in scenes) + " |", "|---|" + "---|" * len(scenes)]
        parts.append("| CPU encode | " + " | ".join(f"{x.cpu_ms:.2f}" for x in b) + " |")
        parts.append("| host syncs | " + " | ".join(f"{x.sync_ms:.2f}" for x in b) + " |")
        for k in b[0].terms:
            parts.append(f"| GPU: {k} | " + " | ".join(f"{x.terms[k]:.2f}" for x in b) + " |")
    return "\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--after", type=Path, default=None, help="JSON of newer ledgers (label -> ledger dict)")
    ap.add_argument("--write-ledger", type=Path, default=None, help="measure this tree's ledgers into this JSON")
    ap.add_argument("--after-label", default="after", help="what to call the newer ledgers' rows")
    ap.add_argument("--refit", action="store_true", help="fit the constants again instead of the stored fit")
    ap.add_argument(
        "--phases",
        nargs="+",
        default=["steady"],
        choices=PHASES,
        help="step-ledger phases --write-ledger measures (post_refine: a steady step after refine stop)",
    )
    args = ap.parse_args(argv)
    after = None
    if args.write_ledger:
        after = write_ledgers(args.write_ledger, args.phases)
    elif args.after:
        after = json.loads(args.after.read_text())
    calib, rms = peers.fit() if args.refit else (peers.CALIBRATED, peers.CALIBRATED_RMS)
    print(report(after, calib, rms, args.after_label))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
