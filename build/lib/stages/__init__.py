"""DVC stage entry points: `python -m stages.<name> --help`. Paths come from dvc.yaml only.

Importing this package pins the CPU numerics (halludetect/core/numerics.py) before any stage loads
torch, so a stage gives the same bytes on any x86-64 machine.
"""

from halludetect.core import numerics

numerics.pin()
