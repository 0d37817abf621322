"""The params stage: one file per stage of the params.yaml values it reads (its dvc.yaml
`meta.params`), `data/params/<stage>.json` (halludetect/runner/params_digests.py says why).

Every other stage depends on its one file instead of listing DVC `params:`, so DVC parses params.yaml
once per `dvc status` rather than once per stage; a params.yaml edit re-runs this stage (a second)
and then exactly the stages whose file changed. It reads no stage's maths.
"""

import argparse
import sys

from halludetect.runner import params_digests


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory of the params files (<stage>.json)")
    args = p.parse_args(argv)
    try:
        written = params_digests.write(args.out)
    except (ValueError, OSError) as e:  # a key params.yaml lacks, a stage without its file, no DVC repository
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: params of {len(written)} stages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
