"""Shared plumbing for the `stages/` entry points: argument parsing, logging, clean errors.

Light on purpose: a stage imports only what it runs, so `stages.report` never loads torch.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from halludetect.config import Params, load_params
from halludetect.core.errors import UserError

log = logging.getLogger("halludetect")

# Errors that describe bad input: printed as one clear message, without a traceback.
# Anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[Exception], ...] = (UserError, FileNotFoundError)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    return p


def setup() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per API request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(run: Callable[[argparse.Namespace, Params], None], p: argparse.ArgumentParser) -> None:
    args = p.parse_args()
    setup()
    try:
        params = load_params(args.params)
        run(args, params)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:  # paid work already done is kept (caches, progress units)
        print(f"interrupted: {e}" if str(e) else "interrupted", file=sys.stderr)
        sys.exit(130)
