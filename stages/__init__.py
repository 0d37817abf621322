"""DVC stage entry points: `python -m stages.<name> --help`. Paths come from dvc.yaml only.

Importing this package pins the CPU numerics (halludetect/core/numerics.py) before any stage loads
torch, so a stage gives the same bytes on any x86-64 machine, and has malloc keep freed memory
for reuse (halludetect/core/allocator.py: a third of a detector's training was the kernel mapping
fresh pages).
"""

from halludetect.core import allocator, numerics

numerics.pin()
allocator.keep_freed_memory()
