"""`halludetect exp-push`: experiments to a git remote, their outputs to the DVC remote configured
now (`halludetect.experiments.sharing`)."""

from __future__ import annotations

import json
import sys

from halludetect.core.errors import UserError


def run(args) -> None:
    from pathlib import Path

    from halludetect.experiments.sharing import push_experiments

    if args.jobs is not None and args.jobs < 1:
        raise UserError(f"-j/--jobs {args.jobs}: give 1 or more parallel uploads")
    result = push_experiments(
        Path("."),
        args.git_remote,
        args.experiments,
        all_commits=args.all_commits,
        rev=args.rev,
        dvc_remote=args.remote,
        force=args.force,
        jobs=args.jobs,
    )
    if diverged := result.get("diverged"):
        raise UserError(
            f"{', '.join(diverged)}: the git remote {args.git_remote} has other experiments of these names; "
            "their git refs were not pushed, their outputs were (--force replaces the git remote's)"
        )
    pushed = sorted(result.get("success", []) + result.get("up_to_date", []))
    if not pushed:
        raise UserError(
            "no experiment to push: none derives from HEAD or a commit before it (-A pushes every "
            "experiment of this clone; `dvc exp list` lists them)"
        )
    for why in result.get("unreadable", {}).values():  # in scope, but no ref to push: say so
        print(f"warning: not pushed: {why}", file=sys.stderr)
    print(
        json.dumps(
            {
                "experiments": pushed,
                "files_uploaded": result.get("uploaded", 0),
                "git_remote": args.git_remote,
                **({"not_pushed": sorted(result["unreadable"])} if result.get("unreadable") else {}),
            },
            indent=2,
        )
    )


def add(sub) -> None:
    ep = sub.add_parser(
        "exp-push",
        help="push experiments to a git remote and their outputs to the DVC remote configured now",
        description="`dvc exp push GIT_REMOTE`, with every experiment's outputs sent to the DVC "
        "remote the workspace configures now, also for experiments run before that remote was "
        "configured (plain DVC looks for a remote in each experiment's own commit and then pushes "
        "no data). Default: the experiments of HEAD and of the commits before it. Run it in the "
        "repository's root.",
    )
    ep.add_argument("git_remote", help="git remote name or URL, e.g. origin")
    ep.add_argument("experiments", nargs="*", help="only these experiments (dvc exp list names them)")
    ep.add_argument("-A", "--all-commits", action="store_true", help="every experiment of this clone")
    ep.add_argument("--rev", help="the experiments of this commit and the commits before it (default: HEAD)")
    ep.add_argument("-r", "--remote", help="DVC remote name (default: the workspace's default remote)")
    ep.add_argument("-f", "--force", action="store_true", help="replace experiments of the same name on the remote")
    ep.add_argument("-j", "--jobs", type=int, help="parallel uploads (dvc push -j)")
    ep.set_defaults(run=run)
