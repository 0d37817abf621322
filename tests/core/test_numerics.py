"""Reproducible CPU numerics (halludetect/core/numerics.py): a stage's bytes do not depend on the
machine's core count, on what the environment asks of torch and MKL, on the CPU's vendor (MKL
runs the branch asked for), or on how many workers train seeds side by side."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch
from support import ROOT, synthetic

from halludetect.core import numerics
from halludetect.detectors.data import split_data
from halludetect.detectors.training import train_seeds
from halludetect.methods.pooling import PoolingParams

# A tiny world trained for one epoch, as the world stage trains it (stages/__init__ pins the
# numerics first), printing a digest of the weights.
WORLD = """
import hashlib, stages
from halludetect.world.kb import build_people, corpus
from halludetect.world.tiny_llama import train_model, train_tokenizer
docs = corpus(build_people(40, [1, 3, 10], ["birth_city", "job"], seed=3), qa_fraction=0.5, seed=3)
model, _ = train_model(docs, train_tokenizer(docs, 400), hidden_size=64, n_layers=2, n_heads=4,
                       intermediate_size=128, epochs=1, batch_size=16, lr=3e-3, seed=0, log=lambda *a: None)
h = hashlib.sha256()
for k, v in sorted(model.state_dict().items()):
    h.update(v.contiguous().numpy().tobytes())
print(h.hexdigest())
"""


def world_digest(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in numerics.PINNED}
    out = subprocess.run(
        [sys.executable, "-c", WORLD], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_world_training_gives_the_same_bytes_whatever_the_machine_asks_for():
    """What differs between machines, emulated here: the core count (torch's default thread
    count) and the kernels torch picks (ATEN_CPU_CAPABILITY: AVX-512 on one CPU, AVX2 or
    baseline on another). Unpinned, each changes the trained weights (checked by hand with
    HALLUDETECT_NUMERICS=native on an AVX-512 machine); pinned, none does. One process asks for
    them all at once: each world costs a process that imports torch and transformers (4 s)."""
    reference = world_digest()
    assert world_digest(OMP_NUM_THREADS="1", MKL_NUM_THREADS="4", ATEN_CPU_CAPABILITY="default") == reference


def test_portable_numerics_ignore_the_instruction_sets_mkl_would_use():
    """MKL's branch depends on the CPU (MKL_ENABLE_INSTRUCTIONS=AVX2 is what a CPU without
    AVX-512 gives it, and an AMD CPU gets a branch of its own); in portable mode it is fixed.
    SSE4_2 is asked for: narrower than any branch this machine's MKL would take, Intel or AMD."""
    reference = world_digest(HALLUDETECT_NUMERICS="portable")
    assert world_digest(HALLUDETECT_NUMERICS="portable", MKL_ENABLE_INSTRUCTIONS="SSE4_2") == reference


X86_LINUX = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64", reason="MKL is in torch's x86-64 Linux wheels only"
)


@X86_LINUX
def test_mkl_runs_the_branch_it_is_asked_for_whatever_the_vendor():
    """On an AMD CPU MKL ignores MKL_CBWR unless its vendor check is answered (it reported AUTO,
    2, on the AMD EPYC of 2026-11-25); pinned, it runs AVX2 in reproducible mode (this process,
    pinned by conftest) and COMPATIBLE in portable mode, on Intel and AMD alike."""
    assert numerics.mkl_branch() == numerics.MKL_BRANCH_CODE["AVX2"]
    clean = {k: v for k, v in os.environ.items() if k not in numerics.PINNED}
    code = "import stages; from halludetect.core import numerics; print(numerics.mkl_branch())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**clean, "HALLUDETECT_NUMERICS": "portable"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(out.stdout) == numerics.MKL_BRANCH_CODE["COMPATIBLE"]


@X86_LINUX
def test_elementwise_sqrt_is_correctly_rounded_as_on_intel():
    """torch's float sqrt is MKL's vector sqrt: on its Intel AVX2 branch the rounded exact root,
    on its AMD branch about 1 element in 6 one ulp off (an AMD EPYC, unshimmed). The pinned
    branch gives numpy's (IEEE) roots on every vendor."""
    x = torch.rand(20_000, generator=torch.Generator().manual_seed(0)) * 10
    np.testing.assert_array_equal(x.sqrt().numpy(), np.sqrt(x.numpy()))


@X86_LINUX
def test_the_mkl_shim_answers_intel_and_a_missing_compiler_is_named(tmp_path, monkeypatch):
    shim = numerics.mkl_intel_shim(tmp_path / "cache")
    assert (
        shim is not None and shim.parent == tmp_path / "cache" and ctypes.CDLL(str(shim)).mkl_serv_intel_cpu_true() == 1
    )
    assert numerics.mkl_intel_shim(tmp_path / "cache") == shim  # built once, then reused
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert numerics.mkl_intel_shim(tmp_path / "other", vendor="GenuineIntel") is None  # MKL says Intel itself
    with pytest.raises(
        RuntimeError, match=r"AuthenticAMD CPU needs a one-line C shim.*no C compiler was found.*apt-get install gcc"
    ):
        numerics.mkl_intel_shim(tmp_path / "other", vendor="AuthenticAMD")


def test_seeds_give_the_same_bytes_however_many_train_together():
    """train_seeds trains a cell's seeds as one batched model: a seed's bytes do not depend on the
    seeds beside it, nor on their order (one alone trains as train_detector does)."""
    layer, labels = synthetic()
    data = {s: split_data(layer, labels, s) for s in ("train", "val", "test")}
    params = PoolingParams(dim=16, dropout=0.2, lr=1e-2, weight_decay=0.0)

    def run(seeds):
        kw = {"epochs": 4, "batch_size": 32}
        out = train_seeds("max", params, data["train"], data["val"], {"test": data["test"]}, seeds, **kw)
        return sorted(out, key=lambda r: r.seed)

    runs = [run([0, 1, 2]), run([2, 0, 1]), [r for s in (0, 1, 2) for r in run([s])]]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert a.seed == b.seed and a.result.best_epoch == b.result.best_epoch
            for k in a.result.state_dict:
                assert torch.equal(a.result.state_dict[k], b.result.state_dict[k])
            np.testing.assert_array_equal(a.scores["test"], b.scores["test"])
    assert not torch.equal(runs[0][0].result.state_dict["head.weight"], runs[0][1].result.state_dict["head.weight"])


def test_pinning_is_refused_after_torch_loaded_and_a_bad_mode_is_named(monkeypatch):
    monkeypatch.setenv("HALLUDETECT_NUMERICS", "reproducible")
    numerics.pin()  # pinned already (conftest): importing a stage module in a test is fine
    monkeypatch.setenv("HALLUDETECT_NUMERICS", "portable")  # other pins, too late: the kernels are chosen
    with pytest.raises(RuntimeError, match="before torch is imported"):
        numerics.pin()
    monkeypatch.setenv("HALLUDETECT_NUMERICS", "fast")
    with pytest.raises(ValueError, match="HALLUDETECT_NUMERICS='fast'"):
        numerics.pin()


@pytest.mark.parametrize(
    ("env", "spins"),
    [({}, numerics.SPIN_COUNT), ({"GOMP_SPINCOUNT": "77"}, "77"), ({"OMP_WAIT_POLICY": "ACTIVE"}, None)],
)
def test_a_stage_process_spins_briefly_unless_the_user_chose_how_threads_wait(env, spins):
    """OpenMP's default wait spins away the time slices of busy cores (SPIN_COUNT's comment): a stage
    process spins SPIN_COUNT times before it sleeps, unless the user set a spin count or a policy."""
    unset = (*numerics.PINNED, "GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "HALLUDETECT_NUMERICS")  # the default mode
    clean = {k: v for k, v in os.environ.items() if k not in unset}
    code = "import os, stages; print(os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == str(spins)
