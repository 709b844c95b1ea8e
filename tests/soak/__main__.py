"""`python -m tests.soak --minutes 30 --seed 1`: the chaos soak (tests/soak/runner.py); exit status 0 when it passed.
`--dry-run` prints the seed's schedule and starts nothing."""

import argparse
import json
import sys
from pathlib import Path

from tests.soak.runner import WORKERS, run_soak
from tests.soak.schedule import build_schedule


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=30.0, help="how long jobs are submitted and faults injected")
    parser.add_argument("--seed", type=int, default=1, help="the schedule's seed: the same seed replays the same soak")
    parser.add_argument(
        "--drain-minutes", type=float, default=15.0, help="after the soak, how long every job may take to end"
    )
    parser.add_argument("--run-dir", type=Path, default=Path("build/soak-run"), help="logs, data, SeaweedFS files")
    parser.add_argument("--report", type=Path, default=Path("build/soak.json"))
    parser.add_argument("--dry-run", action="store_true", help="print the schedule and exit")
    args = parser.parse_args()
    if args.dry_run:
        print(json.dumps(build_schedule(args.seed, args.minutes * 60, workers=WORKERS).to_json(), indent=1))
        return 0
    passed = run_soak(
        minutes=args.minutes,
        seed=args.seed,
        run_dir=args.run_dir,
        report_path=args.report,
        drain_minutes=args.drain_minutes,
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
