"""Experiment refs read with git before DVC reads them (halludetect/experiments/refs.py): what can
be read, with its commits, and why the rest cannot, on repositories made without running anything."""

from support import experiments_repo, git

from halludetect.experiments.refs import MAX_COMMITS, exp_refs


def test_each_ref_is_readable_with_its_commits_or_has_its_problem(tmp_path):
    repo = tmp_path / "repo"
    shas = experiments_repo(repo, dims=(8,), history=MAX_COMMITS + 2)
    base = shas["baseline"]
    prefix = f"refs/exps/{base[:2]}/{base[2:]}"
    # two commits on the baseline, as DVC 2's checkpoints left them: DVC walks both, so both are pushed
    second = git(repo, "commit-tree", f"{shas['dim-8']}^{{tree}}", "-p", shas["dim-8"], "-m", "checkpoint")
    git(repo, "update-ref", f"{prefix}/two-commits", second)
    git(repo, "update-ref", f"{prefix}/far-back", f"HEAD~{MAX_COMMITS + 1}")  # no experiment of this baseline
    git(repo, "update-ref", "refs/exps/ab/not-an-experiment", "HEAD")
    found = {ref.name: ref for ref in exp_refs(repo)}
    assert found["dim-8"].commits == (shas["dim-8"],) and found["dim-8"].problem is None
    assert found["two-commits"].commits == (second, shas["dim-8"]) and found["two-commits"].baseline == base
    assert found["far-back"].problem.startswith(
        f"{prefix}/far-back points at {git(repo, 'rev-parse', '--short=7', f'HEAD~{MAX_COMMITS + 1}')}, which is "
        f"not an experiment of its baseline {base[:7]} (not {MAX_COMMITS} commits or fewer on top of it): remove it"
    )
    assert found["not-an-experiment"].problem == (
        "refs/exps/ab/not-an-experiment is not an experiment ref (refs/exps/<2>/<38>/<name>): remove it "
        "(`git update-ref -d refs/exps/ab/not-an-experiment`)"
    )
