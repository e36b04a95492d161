"""One rank of a launch, as torchrun starts it: ``python -m accel.distributed --config FILE``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

from accel.distributed.config import RunConfig
from accel.distributed.rank import run_rank


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one rank of accel.distributed.launch")
    parser.add_argument("--config", required=True, help="the launch's config.json: its runs")
    args = parser.parse_args(argv)
    path = Path(args.config)
    try:
        run_rank([RunConfig(**fields) for fields in json.loads(path.read_text())], path.parent)
        code = 0
    except BaseException:
        traceback.print_exc()  # into torchrun's output too; the error file has it already
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: gloo's threads can abort it (SIGABRT) after a clean run
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
