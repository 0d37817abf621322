"""Shared plumbing for the `stages/` entry points: argument parsing, logging, clean errors.

Light on purpose: a stage imports only what it runs, so `stages.report` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable

from halludetect.config import Params, is_score, load_params
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


# A score with nothing to train (methods/scores.py) runs in the train and evaluate stages like every
# detector of grid.detectors, and those stages hand it to stages/<family>_score.py. By name, not by an
# import: the code stage follows imports, and the digest of a trained method's stage must not hold the
# scores' code, nor a score's the training's (halludetect/core/code_deps.py, HAND_OVER).
def hand_over(family: str, args: argparse.Namespace, params: Params) -> bool:
    """Run `family` (train, evaluate) of a score here and say True; False for a trained method."""
    if not is_score(args.method):
        return False
    importlib.import_module(f"stages.{family}_score").run(args, params)
    return True
