"""The paper's figures as transcribed in halludetect/report/paper.py, re-read cell by cell from its LaTeX
source, and the identity rules that key them (hub id and loader, never a preset name)."""

import os
import re
from pathlib import Path

import pytest
from support import ROOT

from halludetect.report import paper

CANDIDATES = [
    os.environ.get("HALLUDETECT_PAPER", ""),
    ROOT.parent / "shared/paper/000_044922276df50397.txt",
    Path("/work/shared/paper/000_044922276df50397.txt"),
]
SOURCE = next((Path(p) for p in CANDIDATES if p and Path(p).is_file()), None)
needs_source = pytest.mark.skipif(
    SOURCE is None, reason="the paper's LaTeX source is not on this machine (set HALLUDETECT_PAPER to its path)"
)
NUMBER = re.compile(r"^\d+(?:,\d{3})*(?:\.\d+)?$")


def numeric_rows(label: str) -> list[list[str]]:
    """The numbers of every row of the tabular after \\label{label}, as printed (commas dropped)."""
    text = SOURCE.read_text()
    start = text.index(f"\\label{{{label}}}")
    body = text[start : text.index("\\end{tabular}", start)]
    body = body[body.index("\\begin{tabular}") :]
    rows = []
    for chunk in body.split("\\\\"):
        cells = []
        for cell in chunk.split("&"):
            cell = re.sub(r"\\(?:textcolor|color)\{\w+\}", "", cell)  # colour marks of best / second
            cell = re.sub(r"\\(?:textbf|textit|multirow\{\d\}\{\*\})", "", cell)
            cell = re.sub(r"\\(?:hline|midrule|toprule|bottomrule|cmidrule\(\w*\)\{[\d-]+\})", "", cell)
            cell = cell.replace("{", "").replace("}", "").strip()
            if NUMBER.match(cell):
                cells.append(cell.replace(",", ""))
        if cells:
            rows.append(cells)
    return rows


TWELVE_COLUMNS = [
    ("tab:performance_comparison", paper.AUROC, ["hami", "hami_sp", "mean", "max"]),
    ("tab:raw_vs_reduced", paper.RAW_VS_EXTRACTED, ["raw_mean", "raw_max", "mean", "max"]),
    ("tab:pooling_auc", paper.POOLING_AUROC, ["attention", "gated_attention", "mean", "max"]),
    ("tab:margin_comparison", paper.MARGIN, ["hami", "hami_sp", "mean", "max"]),
    ("tab:std", paper.SD_AUROC, ["hami", "hami_sp", "mean", "max"]),
    ("tab:std_margin", paper.SD_MARGIN, ["hami", "hami_sp", "mean", "max"]),
    ("tab:throughput_comparison", paper.THROUGHPUT, ["hami", "hami_sp", "mean", "max"]),
    ("tab:pooling_speed", paper.POOLING_SPEED, ["attention", "gated_attention", "mean", "max"]),
]


@needs_source
@pytest.mark.parametrize(("label", "table", "methods"), TWELVE_COLUMNS, ids=[t[0] for t in TWELVE_COLUMNS])
def test_twelve_column_tables_match_the_source(label, table, methods):
    rows = numeric_rows(label)
    assert len(rows) == len(methods)
    for method, printed in zip(methods, rows):
        assert [table[method][cell].text for cell in paper.CELLS] == printed, f"{label} {method}"


@needs_source
def test_p_sem_dimension_and_label_tables_match_the_source():
    datasets, models = list(paper.DATASETS), list(paper.MODELS)
    rows = numeric_rows("tab:se_sp_auc")
    assert [[paper.P_SEM_AUROC[(m, d)].text for m in models] for d in datasets] == rows
    for model, label in zip(models, ("tab:dim_max_llama8b", "tab:dim_max_mistral12b", "tab:dim_max_llama70b")):
        sweep = paper.DIM_SWEEP[model]
        assert [[str(dim), *(sweep[dim][d].text for d in datasets)] for dim in sweep] == numeric_rows(label)
    expected = [[f.text for f in paper.LABELS[("llama3.1-8b", d)][s]] for d in datasets for s in ("train", "test")]
    assert expected == numeric_rows("tab:label_dist")


@needs_source
def test_expected_value_tables_match_the_source():
    keys = {"llama3.1-8b": "llama8b", "mistral-nemo-12b": "mistral12b", "llama3.3-70b": "llama70b"}
    checked = 0
    for (variant, model, split), rows in paper.EXPECTED.items():
        label = f"tab:exp_{keys[model]}_{'train' if split == 'train' else 'val'}"
        label += "_non_invariant" if variant == "c_int" else ""
        printed = numeric_rows(label)
        assert [
            [getattr(rows[d], f).text for f in paper.Expected.__dataclass_fields__] for d in paper.DATASETS
        ] == printed, label
        checked += 1
    assert checked == 12  # 3 models x 2 splits x (C_B, C_B^int)


def test_a_few_cells_by_hand():
    assert paper.AUROC["max"][("llama3.3-70b", "trivia_qa")].value == 0.945
    assert paper.MARGIN["hami_sp"][("llama3.1-8b", "squad")].text == "5.10"
    assert paper.THROUGHPUT["hami_sp"][("mistral-nemo-12b", "trivia_qa")].value == 0.28
    assert paper.EXPECTED[("c_int", "llama3.1-8b", "train")]["trivia_qa"].inv_gamma.text == "0.37"


def test_identity_is_the_hub_id_or_the_loader():
    assert paper.model_key("meta-llama/Meta-Llama-3.1-8B") == "llama3.1-8b"
    assert paper.model_key("meta-llama/Llama-3.1-8B") == "llama3.1-8b"  # the hub's later name
    assert paper.model_key("/models/hf/Llama-3.3-70B-Instruct/") == "llama3.3-70b"  # a local download
    assert paper.model_key("MISTRALAI/mistral-nemo-instruct-2407") == "mistral-nemo-12b"
    assert paper.model_key("data/world/model") is None
    assert paper.model_key("meta-llama/Llama-3.1-70B") is None
    assert paper.dataset_key("trivia_qa") == "trivia_qa" and paper.dataset_key("world") is None
