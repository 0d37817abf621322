"""`python -m halludetect.cli`: the `halludetect` command."""

from halludetect.cli import main

main()
