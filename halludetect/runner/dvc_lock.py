"""`dvc` with dvc.lock written entry by entry: DVC's own CLI, its lock writer made O(one stage).

DVC rewrites the whole dvc.lock after every stage it runs (dvc/dvcfile.py, `Lockfile.dump_stages`:
`modify_yaml`, a ruamel round-trip parse of the file, one entry updated, a round-trip dump of all of
it). Each rewrite costs time in proportion to the lock, so one `dvc repro` costs stages x lock: on
the paper's grid (505 stages, a 1.3 MB lock) 6.6 s a rewrite, about half an hour of one
`dvc repro` (docs/benchmarks.md, bench.dag). The work per rewrite is one entry; this makes the
cost that:

    python -m halludetect.runner.dvc_lock repro ...     # what `halludetect repro` (make repro) runs

runs DVC's CLI with the `modify_yaml` that dvc/dvcfile.py calls replaced, for dvc.lock only, by
`LockWriter.modify`, which writes the same bytes:

- the lock's data stays in memory between writes (parsed again, by the C parser, whenever the file
  does not hold exactly the text this process last wrote: another process, a `git checkout`);
- the file is the header and each stage's entry as text, in order; an entry's text is DVC's own
  dumper's (`dvc.utils.serialize._yaml._dump`) output for that entry alone, kept while the entry's
  value is unchanged, so one write dumps the entries that changed and joins strings. A YAML block
  mapping's entries are emitted independently of each other, so the join is the bytes DVC's dump of
  the whole file gives (tests/runner/test_dvc_lock.py compares them on real locks;
  HALLUDETECT_CHECK_LOCK=1 compares every write and stops at the first difference);
- the file is written atomically (DVC truncates and writes in place: a kill could leave half a lock);
  a kill between the two steps leaves a `.dvc.lock.*` beside it, which git ignores.

A lock this writer cannot reproduce exactly goes to DVC's own function: a file that is not what
DVC's dumper writes for its own data (a hand edit, a comment, an anchor: DVC's round trip keeps them),
one with other top-level keys than `schema` and `stages` (`datasets`), an empty `stages`, an entry
whose dump holds an anchor, a file system other than the local one. If DVC's internals are not the
ones this was written against, DVC runs unpatched, with a warning. Plain `dvc repro` and `dvc exp
run` keep DVC's writer: the bytes are the same either way.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import warnings
from pathlib import Path

LOCK_NAME = "dvc.lock"
CHECK_ENV = "HALLUDETECT_CHECK_LOCK"
JOBS_ENV = "HALLUDETECT_REPRO_JOBS"  # stages at once (runner/parallel_repro.py); set by `halludetect repro --jobs`


class LockWriter:
    """The `modify_yaml` of dvc.lock: data kept between writes, each entry's text kept by its value."""

    def __init__(self, original, dump):
        self.original = original  # DVC's modify_yaml, for every other file and case
        self.dump = dump  # DVC's dumper: dump(data, stream)
        self.data: dict | None = None  # the lock as last written by this process
        self.written: str | None = None  # the text of that write
        self.texts: dict[tuple[str, str], str] = {}  # (stage, repr of its value) -> its text
        self.check = os.environ.get(CHECK_ENV) == "1"
        # Stages run side by side (runner/parallel_repro.py) finish in no fixed order, and DVC appends
        # an entry new to a lock as its stage finishes: `order` ((lock path, stage) -> its place in
        # the run's plan) puts the entries new since this process first read that lock after the
        # others, in plan order, which is where a serial run, finishing in plan order, puts them.
        self.order: dict[tuple[str, str], int] | None = None
        self.initial: dict[str, set[str]] = {}  # lock path -> the stages it held when this process first read it

    @contextlib.contextmanager
    def modify(self, path, fs=None):
        if Path(os.fspath(path)).name != LOCK_NAME or (fs is not None and getattr(fs, "protocol", None) != "local"):
            with self.original(path, fs=fs) as data:
                yield data
            return
        path = os.fspath(path)
        key = os.path.abspath(path)
        data = self._load(path)
        if data is None:  # a file DVC's round trip must keep as it is (comments, anchors, hand edits)
            with self.original(path, fs=fs) as data:
                self._first_read(key, data)
                yield data
                self._plan_order(key, data)
            return
        self._first_read(key, data)
        try:
            yield data
            self._plan_order(key, data)
            text = self.text(data)
            if text is None:  # a shape this writer does not reproduce: DVC's own dump
                self.data = self.written = None
                with open(path, "w+", encoding="utf-8") as fd:
                    self.dump(data, fd)
                return
            if self.check:
                whole = io.StringIO()
                self.dump(data, whole)
                if whole.getvalue() != text:
                    raise AssertionError(f"{CHECK_ENV}: the entry-wise dvc.lock differs from DVC's dump of {path}")
            _write_atomically(path, text)
        except BaseException:
            self.data = self.written = None  # changed in memory, maybe not written: read the file next time
            raise
        self.data, self.written = data, text

    def _first_read(self, key: str, data) -> None:
        if key not in self.initial:
            stages = data.get("stages") if isinstance(data, dict) else None
            self.initial[key] = set(stages or {})

    def _plan_order(self, key: str, data) -> None:
        if self.order is not None:
            _plan_order(data, self.initial[key], {name: i for (lock, name), i in self.order.items() if lock == key})

    def _load(self, path: str) -> dict | None:
        """The lock's data: kept from this process's last write when the file still holds exactly that
        text, else parsed (the C parser where ruamel has it); None when the file is not what DVC's dumper
        writes for its own data (a hand edit, a comment), which only DVC's round trip keeps."""
        try:
            with open(path, encoding="utf-8") as fd:
                text = fd.read()
        except FileNotFoundError:
            self.data = self.written = None
            return {}
        except UnicodeDecodeError:  # DVC's reader names it
            return None
        if self.data is not None and text == self.written:
            return self.data
        self.data = self.written = None
        from ruamel.yaml import YAML

        try:
            data = YAML(typ="safe").load(text) or {}
        except Exception:  # a corrupted lock: DVC's reader names the problem
            return None
        if not isinstance(data, dict) or (data and self.text(data) != text):
            return None
        return data

    def text(self, data: dict) -> str | None:
        """The lock's text from its entries' kept texts, or None for a shape DVC must dump itself."""
        if list(data) != ["schema", "stages"] or not isinstance(data["stages"], dict) or not data["stages"]:
            return None
        header = self._dump({"schema": data["schema"]})
        parts, used = [header, "stages:\n"], set()
        for name, entry in data["stages"].items():
            key = (name, repr(entry))  # repr keeps key types apart (1 and "1"), where JSON would not
            used.add(key)
            if key not in self.texts:
                one = self._dump({"stages": {name: entry}})
                if not one.startswith("stages:\n") or "&id" in one:  # anchors are numbered over the whole file
                    return None
                self.texts[key] = one[len("stages:\n") :]
            parts.append(self.texts[key])
        for key in set(self.texts) - used:  # entries replaced or removed: their texts go
            del self.texts[key]
        return "".join(parts)

    def _dump(self, data: dict) -> str:
        buf = io.StringIO()
        self.dump(data, buf)
        return buf.getvalue()


def _plan_order(data: dict, initial: set[str], order: dict[str, int]) -> None:
    """Reorder data["stages"] in place: the entries in `initial` as they are, then the others by
    their place in `order` (those it does not name last, as they came). Keys are moved, never
    rebuilt, so a round-trip mapping (DVC's own writer's) keeps the comments attached to them."""
    stages = data.get("stages") if isinstance(data, dict) else None
    if not isinstance(stages, dict):
        return
    new = [k for k in stages if k not in initial]
    want = [k for k in stages if k in initial] + sorted(new, key=lambda k: order.get(k, len(order)))  # stable
    if want == list(stages):
        return
    first = next(i for i, (k, w) in enumerate(zip(stages, want)) if k != w)
    for k in want[first:]:  # from the first misplaced one on, each to the end in turn
        if hasattr(stages, "move_to_end"):
            stages.move_to_end(k)
        else:
            stages[k] = stages.pop(k)


def _write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".dvc.lock.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        if os.path.exists(path):
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def install() -> LockWriter | None:
    """Replace dvc/dvcfile.py's modify_yaml with a LockWriter's; None (and a warning) when DVC is not
    shaped as expected."""
    from halludetect.runner import dvc_internals

    try:
        dvcfile = dvc_internals.get("dvcfile")
        original, dump = dvc_internals.get("dvcfile.modify_yaml"), dvc_internals.get("yaml._dump")
        dvc_internals.get("dvcfile.Lockfile.dump_stages")
        if original is not dvc_internals.get("yaml.modify_yaml"):
            raise dvc_internals.Missing(
                f"DVC {dvc_internals.version()}'s dvc/dvcfile.py no longer writes its lock through modify_yaml"
            )
    except dvc_internals.Missing as e:
        warnings.warn(f"dvc.lock is written by DVC's own writer: {e}", stacklevel=2)
        return None
    writer = LockWriter(original, dump)
    dvcfile.modify_yaml = writer.modify
    return writer


def main(argv: list[str] | None = None) -> int:
    writer = install()
    if jobs := os.environ.get(JOBS_ENV):  # halludetect repro --jobs N
        from halludetect.runner import parallel_repro

        parallel_repro.install(parallel_repro.jobs_from(jobs), writer)
    from halludetect.runner.dvc_internals import main as dvc_main

    return dvc_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
