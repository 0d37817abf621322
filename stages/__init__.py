"""DVC stage entry points: `python -m stages.<name> --help`. Paths come from dvc.yaml only."""
