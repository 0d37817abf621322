"""Shared plumbing for the `stages/` entry points: argument parsing, logging, clean errors."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

import torch

from halludetect.config import Params, ParamsError, load_params
from halludetect.datasets import DatasetError
from halludetect.llm import ApiError
from halludetect.modeling import ModelError
from halludetect.registry import UnknownName
from halludetect.training import DataError

log = logging.getLogger("halludetect")

# Errors that describe bad input: printed as one clear message, without a traceback.
# Anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[Exception], ...] = (
    ParamsError, DatasetError, ModelError, DataError, UnknownName, FileNotFoundError, ApiError,
)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    return p


def setup() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpx2", "openai"):  # one INFO line per API request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Two threads on the 2-core machines; more where the machine has more.
    torch.set_num_threads(int(os.environ.get("HALLUDETECT_THREADS", os.cpu_count() or 1)))


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
