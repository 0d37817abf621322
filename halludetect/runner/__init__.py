"""The runner: how the pipeline runs under DVC. `halludetect repro` (repro.py: the plan and the
progress line) runs DVC's CLI with dvc.lock written entry by entry (dvc_lock.py), independent
stages side by side (parallel_repro.py), stage commands forked from a process that has imported
their libraries (zygote.py); dag.py draws DVC's graph a family per line. dvc_internals.py is the
one module that imports DVC: every DVC name the runner and the experiments use, with the DVC
versions they were tested on. Only the command line, the experiments and bench/ import this
package; the stages never do.
"""
