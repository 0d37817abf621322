"""The code stage: one digest file per stage module (and per method, for the modules that run
methods/), the sha256 of every file of its import closure (halludetect/core/code_deps.py).

Every other stage lists its one digest file instead of its ~35 code files, so dvc.lock stays small
and DVC rewrites it fast after each stage, while an edit to a file still re-runs exactly the stages
whose closure holds it: this stage re-runs on any edit (a second), and only the digests that hold the
edited file change. It reads no params and imports nothing of the pipeline's maths.
"""

import argparse
import sys

from halludetect.core import code_deps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory of the digest files (<module>[/<method>].txt)")
    args = p.parse_args(argv)
    try:
        written = code_deps.write_digests(args.out)
    except (ValueError, OSError, SyntaxError) as e:  # a module that does not parse, an unreadable file
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {len(written)} code digests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
