"""The data a detector trains and is evaluated on: one split of one layer file, packed and checked.

A layer file (packed states + offsets) and the judge's kept labels (+ P_sem for the methods
that read it) give one `SplitData` per split: tokens [N, d], offsets [B + 1], y [B]. Responses
without tokens, or without P_sem when it is needed, are left out and counted. Bad input stops
here, before any training: labels without states, a split with one class, non-finite states,
layer files from different dumps.

Per method (methods/): bags too short for the token it reads are left out (`too_short`); a method
that scores a question's answers together gets each bag's question (`groups`, bags ordered by
question) and loses questions with one evaluated answer (`one_answer`); a method trained on the
semantic entropy gets it per train response (`entropy`), and loses train responses whose question
has none (`no_semantic_entropy`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import torch

from halludetect.activations.bags import Bags, gather_rows
from halludetect.activations.layer_reader import Layer
from halludetect.core.errors import DataError
from halludetect.labels.readers import read_clusters
from halludetect.methods import CLUSTER_METHODS, SP_METHODS
from halludetect.methods import method as lookup_method
from halludetect.metrics import check_two_classes
from halludetect.qa.responses import response_ids

SPLITS = ("train", "val", "test")


@dataclass
class SplitData:
    """One split of one layer, packed: tokens [N, d], offsets [B + 1], y [B] in {0, 1}."""

    tokens: torch.Tensor
    offsets: torch.Tensor
    y: torch.Tensor
    response_ids: list[str]
    p_sem: torch.Tensor | None = None  # [B], for the methods that read it
    excluded: dict = field(default_factory=dict)  # reason -> count of labelled responses left out
    layer_index: np.ndarray | None = None  # [B] each bag's position in the layer file
    groups: torch.Tensor | None = None  # [B] each bag's question (ids 0..), for per-question methods
    entropy: torch.Tensor | None = None  # [B] its question's semantic entropy, for methods trained on it

    def __len__(self) -> int:
        return len(self.y)

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def bags(self, index: torch.Tensor) -> Bags:
        """Bags `index` (any order), gathered into a packed batch."""
        rows, lengths = gather_rows(self.offsets, index)
        p = None if self.p_sem is None else self.p_sem[index]
        g = None if self.groups is None else self.groups[index]
        return Bags(self.tokens[rows], lengths, p, g)

    def slice(self, start: int, stop: int) -> Bags:
        """Bags start..stop-1 in order: a view, no copy."""
        a, b = int(self.offsets[start]), int(self.offsets[stop])
        p = None if self.p_sem is None else self.p_sem[start:stop]
        g = None if self.groups is None else self.groups[start:stop]
        return Bags(self.tokens[a:b], self.lengths[start:stop], p, g)

    def batches(self, batch_size: int) -> list[tuple[int, int]]:
        """Contiguous (start, stop) ranges of about `batch_size` bags; with `groups`, a question's
        answers (contiguous: select orders them) always share a batch."""
        n, out, a = len(self), [], 0
        while a < n:
            b = min(a + batch_size, n)
            if self.groups is not None:
                while b < n and self.groups[b] == self.groups[b - 1]:
                    b += 1
            out.append((a, b))
            a = b
        return out

    def to(self, device) -> SplitData:
        def move(t):
            return None if t is None else t.to(device)

        return SplitData(
            self.tokens.to(device),
            self.offsets.to(device),
            self.y.to(device),
            self.response_ids,
            move(self.p_sem),
            self.excluded,
            self.layer_index,
            move(self.groups),
            move(self.entropy),
        )


def labelled_index(
    ids: list[str], judgments: pl.DataFrame, split: str, source: str = "layer"
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Positions in a layer file (response `ids`), labels and ids of the kept responses of `split`."""
    kept = judgments.filter(pl.col("kept") & (pl.col("split") == split)).select(
        response_ids(judgments).alias("rid"), "label"
    )
    position = {rid: i for i, rid in enumerate(ids)}
    missing = [rid for rid in kept["rid"] if rid not in position]
    if missing:
        raise DataError(
            f"{len(missing)} labelled {split} responses have no states in {source} "
            f"(e.g. {missing[:3]}): labels and activations disagree; re-run dump and judge"
        )
    index = np.asarray([position[rid] for rid in kept["rid"]], dtype=np.int64)
    return index, kept["label"].to_numpy().astype(np.int64), kept["rid"].to_list()


def select(
    ids: list[str],
    offsets: np.ndarray,
    judgments: pl.DataFrame,
    split: str,
    source: str,
    p_sem: dict[str, float] | None = None,
    *,
    method: str | None = None,
    entropy: dict[str, float] | None = None,
) -> tuple[np.ndarray, np.ndarray, list[str], dict]:
    """The responses of `split` a detector can use: labelled, with tokens, with P_sem when it
    is needed, and what `method` needs (module docstring). Returns positions, labels, ids and the
    counts left out, by reason."""
    index, y, rids = labelled_index(ids, judgments, split, source)
    lengths = np.diff(offsets)[index]
    keep = lengths > 0
    excluded = {"empty_bag": int((~keep).sum())}
    spec = None if method is None else lookup_method(method)
    reads = None if spec is None else spec.reads
    if reads is not None and reads.min_tokens > 1:
        short = keep & (lengths < reads.min_tokens)
        excluded["too_short"] = int(short.sum())
        keep &= ~short
    if p_sem is not None:
        has = np.asarray([rid in p_sem for rid in rids], dtype=bool)
        excluded["no_p_sem"] = int((keep & ~has).sum())
        keep &= has
    if entropy is not None:
        has = np.asarray([rid in entropy for rid in rids], dtype=bool)
        excluded["no_semantic_entropy"] = int((keep & ~has).sum())
        keep &= has
    if reads is not None and reads.question and (split != "train" or spec.fit.target is not None):
        # (an unsupervised method never scores the train split, where only sample 0 is dumped)
        question = np.asarray([r.rsplit("/", 1)[0] for r in rids])
        kept_per_q = pl.DataFrame({"q": question[keep]}).group_by("q").len()
        alone = set(kept_per_q.filter(pl.col("len") < 2)["q"].to_list())
        lonely = keep & np.isin(question, list(alone))
        excluded["one_answer"] = int(lonely.sum())
        keep &= ~lonely
    index, y, rids = index[keep], y[keep], [r for r, k in zip(rids, keep) if k]
    if reads is not None and reads.question:  # a question's answers side by side (batches keep them together)
        order = sorted(range(len(rids)), key=lambda i: (rids[i].rsplit("/", 1)[0], int(rids[i].rsplit("/", 1)[1])))
        index, y, rids = index[order], y[order], [rids[i] for i in order]
    check_two_classes(y, split)
    return index, y, rids, excluded


def p_sem_table(clusters: pl.DataFrame, variant: str) -> dict[str, float]:
    """response id -> P_sem (the `variant` column) of the responses whose question clustered."""
    ok = clusters.filter(pl.col("valid"))
    return dict(zip(ok.select(response_ids(ok)).to_series().to_list(), ok[f"p_sem_{variant}"].to_list()))


def split_data(
    layer: Layer,
    judgments: pl.DataFrame,
    split: str,
    source: str = "layer",
    p_sem: dict[str, float] | None = None,
    *,
    method: str | None = None,
    entropy: dict[str, float] | None = None,
) -> SplitData:
    """The packed, checked data of one split. Responses without tokens, or (when `p_sem` is
    given) without a semantic probability, are left out and counted in `excluded`; so are those
    `method` cannot score, and (when `entropy` is given) those without a semantic entropy."""
    index, y, rids, excluded = select(
        layer.response_ids, layer.offsets, judgments, split, source, p_sem, method=method, entropy=entropy
    )
    offsets = torch.from_numpy(layer.offsets)
    rows, lengths = gather_rows(offsets, torch.from_numpy(index))
    tokens = torch.from_numpy(np.asarray(layer.states[rows.numpy()], dtype=np.float32))
    finite = torch.isfinite(tokens).all(1)  # [N]
    if not finite.all():
        bag = int(torch.repeat_interleave(torch.arange(len(index)), lengths)[~finite][0])
        raise DataError(
            f"{source}: non-finite hidden states (NaN or inf) in response {rids[bag]}; "
            "re-run dump (a float16 overflow? try dump.dtype: float32)"
        )
    return SplitData(
        tokens=tokens,
        offsets=torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)]),
        y=torch.from_numpy(y).float(),
        response_ids=rids,
        p_sem=None if p_sem is None else torch.tensor([p_sem[r] for r in rids], dtype=torch.float32),
        excluded=excluded,
        layer_index=index,
        groups=_groups(rids) if method is not None and lookup_method(method).reads.question else None,
        entropy=None if entropy is None else torch.tensor([entropy[r] for r in rids], dtype=torch.float64),
    )


def _groups(rids: list[str]) -> torch.Tensor:
    """[B] an integer id per question, from the response ids ("question_id/sample_index")."""
    _, ids = np.unique(np.asarray([r.rsplit("/", 1)[0] for r in rids]), return_inverse=True)
    return torch.from_numpy(ids.astype(np.int64))


def p_sem_for(method: str, clusters: str | Path | None, method_params) -> dict[str, float] | None:
    """P_sem by response id for the methods that read it (None for the others); a missing or
    unexpected --clusters fails here, before any file of states is read."""
    if method in CLUSTER_METHODS:
        if not clusters:
            raise DataError(f"{method} reads the clustering: pass --clusters (or --routed, as dvc.yaml does)")
        return p_sem_table(read_clusters(clusters), method_params.p_sem) if method in SP_METHODS else None
    if clusters:
        raise DataError(f"{method} does not read the clustering: train it without --clusters")
    return None


def entropy_for(method: str, clusters: str | Path | None, method_params) -> dict[str, float] | None:
    """Semantic entropy by response id (each answer gets its question's) for the methods trained
    on it, None for the others."""
    if lookup_method(method).fit.target != "semantic_entropy":
        return None
    if not clusters:
        raise DataError(f"{method} is trained on the semantic entropy: pass --clusters (or --routed, as dvc.yaml does)")
    ok = read_clusters(clusters).filter(pl.col("valid"))
    column = f"semantic_entropy_{method_params.entropy}"
    return dict(zip(ok.select(response_ids(ok)).to_series().to_list(), ok[column].to_list()))
