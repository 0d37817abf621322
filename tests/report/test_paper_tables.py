"""The paper's tables from metrics JSON (halludetect/report/paper_tables.py): layouts, best/second
marks per family, the paper's figures matched by model and dataset identity whatever the presets are
called, the report stage, and every table compiling with LaTeX."""

import json
import subprocess
import sys

import pytest
import yaml
from support import ROOT, pdflatex

from halludetect.config import parse_params
from halludetect.report.cells import Grid
from halludetect.report.paper_tables import build_tables, load_metrics
from halludetect.report.sweep_tables import sweep_table
from halludetect.report.tables import Cell, Row, Table, to_latex, to_markdown


def entry(auroc=0.8, margin=1.5, sd=0.01, layer=2, family="detector", **extra):
    stat = lambda m: {"mean": m, "stderr": sd / 2, "sd": sd, "per_seed": [m]}  # noqa: E731
    test = {
        "auroc": stat(auroc),
        "auprc": stat(0.7),
        "prr": stat(0.5),
        "prr_0.5": stat(0.4),
        "fpr_at_95_tpr": stat(0.3),
        "margin": stat(margin) if family == "detector" else None,
        "auroc_ci95": [auroc - 0.02, auroc + 0.02],
        "margin_by_length": {
            "<=5": {"n": 3, "n_hallucinated": 1, "margin": stat(margin)},
            "6-30": {"n": 2, "n_hallucinated": 1, "margin": stat(margin)},
            ">30": {"n": 0, "n_hallucinated": 0, "margin": None},
        },
    }
    out = {"family": family, "best_layer": layer if family == "detector" else None, "test": test}
    if family == "detector":
        out["throughput"] = {"preloaded_samples_per_s": 5000.0, "end_to_end_samples_per_s": 800.0, "device": "cpu"}
    return out | extra


def trained(method="max", seeds=(0, 1, 2), **extra):
    """An evaluate entry with what training records: seeds, params, the last epoch, the margins
    by epoch, the recipe and the training time."""
    stat = lambda m: {"mean": m, "stderr": 0.01, "sd": 0.02, "per_seed": [m] * len(seeds)}  # noqa: E731
    params = {"p_sem": "sum", "lam": 1.0} if method == "hami_sp" else {}
    return entry(
        method=method,
        seeds=list(seeds),
        params=params,
        last_epoch={"epoch": 100, "test": {"margin": stat(1.2), "auroc": stat(0.8)}},
        margin_by_epoch={"train": [0.1 * i for i in range(1, 101)], "val": [0.05 * i for i in range(1, 101)]},
        train={"recipe": "paper", "epochs": 100, "batch_size": 128},
        training_time={
            "mean_seconds_per_seed": 12.5,
            "seconds_per_seed": {str(s): 12.5 for s in seeds},
            "wall_seconds": 20.0,
            "parallel_workers": len(seeds),
            "device": "cpu",
            "layer": 2,
            "layers": 5,
            "all_layers_mean_seconds_per_seed": 60.0,
            "all_layers_wall_seconds": 100.0,
        },
        **extra,
    )


def renamed_params() -> dict:
    """The shipped params with the paper's models and datasets under names of the user's own."""
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    data["models"]["my-llama"] = data["models"].pop("llama3-8b")
    data["datasets"]["tqa"] = {"loader": "trivia_qa", "path": "inputs/tqa.jsonl"}
    # no transfer: the test has no transfer results to read
    data["grid"] |= {"models": ["my-llama", "world"], "datasets": ["tqa"], "transfer": []}
    return data


def grid_of(data: dict) -> Grid:
    p = parse_params(data)
    from halludetect.report import paper

    return Grid(
        p.grid.models,
        p.grid.datasets,
        {m: paper.model_key(p.model(m).path) for m in p.grid.models},
        {d: paper.dataset_key(p.dataset(d).loader) for d in p.grid.datasets},
    )


def test_renaming_a_preset_keeps_the_paper_figure():
    grid = grid_of(renamed_params())
    assert grid.paper_cell("my-llama", "tqa") == ("llama3.1-8b", "trivia_qa")
    assert grid.paper_cell("world", "tqa") is None
    metrics = {
        (m, "tqa", method): entry(0.9 if method == "max" else 0.85)
        for m in ("my-llama", "world")
        for method in ("hami", "hami_sp", "mean", "max")
    }
    auroc = next(t for t in build_tables(metrics, grid) if t.name == "auroc")
    md = to_markdown(auroc)
    assert "| Max pooling | **0.900** ± 0.005 [0.880, 0.920] L2 (0.928) | **0.900** ± 0.005 [0.880, 0.920] L2 |" in md
    assert "| HaMI (SP) | <u>0.850</u> ± 0.005 [0.830, 0.870] L2 (0.923) |" in md
    tex = to_latex(auroc)
    assert r"\textbf{0.900}$\pm$0.005 {\scriptsize[0.880, 0.920]} {\scriptsize L2} (0.928)" in tex
    assert r"\multicolumn{1}{c}{my-llama}" in tex and r"\label{tab:ours_auroc}" in tex
    assert "\\midrule\nMean pooling" in tex  # the paper's rule between HaMI and the poolings


def test_margins_after_the_last_epoch_beside_the_paper_then_at_the_best_epoch_and_the_gains():
    grid = grid_of(renamed_params())
    one = Grid(["my-llama"], ["tqa"], grid.model_keys, grid.dataset_keys)

    def with_last(best, last, sd=0.01):
        stat = {"mean": last, "stderr": sd / 2, "sd": sd * 3, "per_seed": [last] * 3}
        return entry(margin=best, seeds=[0, 1, 2], last_epoch={"epoch": 100, "test": {"margin": stat}})

    metrics = {
        ("my-llama", "tqa", m): with_last(best, last)
        for m, best, last in (("hami", 6.0, 5.0), ("hami_sp", 9.0, 8.0), ("mean", 2.0, 1.0), ("max", 2.3, 1.5))
    }
    tables = {t.name: t for t in build_tables(metrics, one)}
    t = tables["margin"]
    md = to_markdown(t)
    labels = [r.label for r in t.rows]
    assert labels[:8] == [
        *(f"{n}, after epoch 100" for n in ("HaMI", "HaMI (SP)", "Mean pooling", "Max pooling")),
        *(f"{n}, at the best validation epoch" for n in ("HaMI", "HaMI (SP)", "Mean pooling", "Max pooling")),
    ]
    # ranked within each family and each reading
    assert [r.cells[0].mark for r in t.rows[:8]] == ["second", "best", "second", "best"] * 2
    # the paper's margins are after its last epoch: beside that reading only, over its 5 runs
    assert "| HaMI (SP), after epoch 100 | **8.000** ± 0.005 L2 (9.02, 5 runs) |" in md
    assert "| HaMI (SP), at the best validation epoch | **9.000** ± 0.005 L2 |" in md
    # gains in %: ours from the seed means, the paper's from its table (144.0 is its LLaMA-3.1-8B SQuAD)
    assert "| HaMI (SP) over HaMI, % (after epoch 100) | 60.0 (46.2) |" in md  # 9.02 / 6.17
    assert "| Max over mean, % (after epoch 100) | 50.0 (13.5) |" in md  # 2.299 / 2.026
    assert "| Max over mean, % (at the best validation epoch) | 15.0 |" in md
    assert "ours over 3 seeds per cell" in t.caption
    sd = to_markdown(tables["sd_margin"])
    assert "| HaMI | 0.030 (0.128, 5 runs) |" in sd  # the last epoch's SD, as the paper's
    assert all(c.mark == "" for r in tables["sd_auroc"].rows for c in r.cells)
    assert "| HaMI | 0.010 (0.009, 5 runs) |" in to_markdown(tables["sd_auroc"])


def test_the_papers_144_and_20_9_percent_margin_gains_come_out_of_its_table():
    from halludetect.report import paper
    from halludetect.report.margin_tables import _gain

    m = paper.MARGIN
    squad, nq = ("llama3.1-8b", "squad"), ("llama3.1-8b", "nq")
    assert f"{_gain(m['hami_sp'][squad].value, m['hami'][squad].value):.1f}" == "144.0"
    assert f"{_gain(m['max'][nq].value, m['mean'][nq].value):.1f}" == "20.9"


def test_captions_name_the_seeds_and_the_p_sem_variant_and_flag_other_run_counts():
    grid = grid_of(renamed_params())
    two = Grid(["my-llama", "world"], ["tqa"], grid.model_keys, grid.dataset_keys)
    params = {"p_sem": "sum", "lam": 1.0}
    metrics = {
        ("my-llama", "tqa", "hami_sp"): entry(0.9, seeds=[0, 1, 2, 3, 4], method="hami_sp", params=params),
        ("world", "tqa", "hami_sp"): entry(0.8, seeds=[0, 1, 2], method="hami_sp", params=params),
        ("my-llama", "tqa", "max"): entry(0.85, seeds=[0, 1, 2, 3, 4], method="max"),
        ("world", "tqa", "max"): entry(0.7, seeds=[0, 1, 2], method="max"),
        ("my-llama", "tqa", "p_sem"): entry(0.8, family="baseline", method="p_sem", params={"variant": "mean"}),
        ("world", "tqa", "p_sem"): entry(0.7, family="baseline", method="p_sem", params={"variant": "mean"}),
    }
    tables = {t.name: t for t in build_tables(metrics, two)}
    auroc = tables["auroc"]
    assert "ours over 3 to 5 seeds (each cell's count in its note)" in auroc.caption
    assert "HaMI (SP) scales by (1 + λ P_sem), λ = 1, P_sem summed" in auroc.caption
    md = to_markdown(auroc)
    # five seeds: the paper's figure as printed; every cell names its own count
    five, three = "**0.900** ± 0.005 [0.880, 0.920] L2 5 seeds (0.923)", "**0.800** ± 0.005 [0.780, 0.820] L2 3 seeds"
    assert f"| HaMI (SP) | {five} | {three} |" in md
    assert "P_sem summed: each answer weighs its likelihood P(A|q)" in md  # the variant defined in the notes
    assert "P_sem length-normalised" in tables["p_sem_auroc"].caption
    assert (
        "HaMI (SP) scales" in tables["detection_auroc"].caption
        and "the P_sem baseline is 1 - P_sem length-normalised" in tables["detection_auroc"].caption
    )
    assert "P_sem" in tables["throughput"].caption
    tex = to_latex(auroc)
    assert r"(1 + $\lambda$ P\_sem)" in tex


def test_throughput_has_both_hami_sp_costs_and_the_paper_figure_by_the_sequential_one():
    grid = grid_of(renamed_params())
    one = Grid(["my-llama"], ["tqa"], grid.model_keys, grid.dataset_keys)
    metrics = {("my-llama", "tqa", m): entry() for m in ("hami", "mean", "max")}
    metrics[("my-llama", "tqa", "hami_sp")] = entry(
        cost={"samples_per_s_with_sampling_and_nli": 177.0, "sequential_samples_per_s": 0.35}
    )
    md = to_markdown(next(t for t in build_tables(metrics, one) if t.name == "throughput"))
    assert "| HaMI (SP) with sampling and NLI, amortised | <u>177</u> cpu |" in md  # second: ranked with all
    assert "| HaMI (SP) with sampling and NLI, sequential | 0.35 cpu (0.17) |" in md
    assert "| Max pooling | **5,000** cpu (5446) |" in md


def test_expected_value_tables_follow_the_paper_and_carry_its_figures():
    grid = grid_of(renamed_params())
    one = Grid(["my-llama"], ["tqa"], grid.model_keys, grid.dataset_keys)
    cls = lambda p, c: {"n": 10, "p_sem": p, "c": c, "p_sem_c": p * c}  # noqa: E731
    mean = {
        "neg": cls(0.9, 19.0),
        "pos": cls(0.45, 13.0),
        "gamma": 2.92,
        "inv_gamma": 0.342,
        "class_ratio": 3.0,
        "condition_applies": True,
        "condition_holds_seeds": [3, 3],
        "margin_widens_seeds": [3, 3],
    }
    # HaMI under HaMI (SP)'s scaling: E_pos[P_sem C] < 0, where the ratio form does not apply
    negative = mean | {
        "pos": cls(0.45, -2.0),
        "gamma": -19.0,
        "inv_gamma": -0.05,
        "condition_applies": False,
        "condition_holds_seeds": [0, 0],
        "margin_widens_seeds": [3, 3],
    }
    margin = {"unscaled": 1.0, "scaled": 1.5, "change": 0.5, "change_from_c_int": 0.4999, "change_from_c0": 0.61}

    def analysed(layer, lam, m, gap):
        split = {
            "mean": {"c0": m, "c_int": m},
            "margin": margin,
            "path_check": {"max_abs_identity_gap": gap, "tolerance": 0.01, "within_tolerance": gap <= 0.01},
        }
        return {
            "best_layer": layer,
            "lam": lam,
            "p_sem": "sum",
            "seeds": [0, 1, 2],
            "layers": {str(layer): {"train": split, "test": split}},
        }

    analysis = {
        ("my-llama", "tqa", "hami_sp"): analysed(7, 1.0, mean, 0.002),
        ("my-llama", "tqa", "hami"): analysed(5, 1.0, negative, 0.03),
    }
    tables = {t.name: t for t in build_tables({}, one, analysis=analysis)}
    assert set(tables) == {f"expected_{v}_my-llama_{s}" for v in ("c0", "c_int") for s in ("train", "test")}
    t = tables["expected_c_int_my-llama_test"]
    assert t.paper_label == "tab:exp_llama8b_val_non_invariant"
    md = to_markdown(t)
    assert "| tqa (layer 7) | 0.450 (0.451) | 0.900 (0.926) | 13.0 (13.7) | 19.0 (19.2) |" in md
    assert "| 2.92 (2.49) | 0.34 (0.40) | 3.00 | 3/3 seeds | 3/3 seeds | 0.500 | 0.500 |" in md
    # the ratio form does not apply: gamma and 1/gamma blank, the reason in the notes; the margin still widens
    assert "| tqa (layer 5, HaMI under λ = 1) |" in md
    assert "| - | - | 3.00 | n/a: E[P_sem C] <= 0 | 3/3 seeds | 0.500 | 0.500 |" in md
    assert "γ and 1/γ blank where E[P_sem C] <= 0 in a class" in md
    # the paper's ranges over its cells, and the range its text quotes
    assert "| the paper (range over its cells) |" in md and "| 1.92–2.85 | 0.35–0.52 | 0.51–3.26 |" in md
    assert "its text quotes 1/γ from 0.37 to 0.52" in md
    assert "WARNING: the path identity" in md and "tqa (HaMI): 0.03" in md  # over analyze.path_tolerance
    assert "λ = 1, P_sem summed; 3 seeds" in t.caption and "best layer on validation (in the row)" in t.caption
    assert "re-ranked at every step" in md  # which top-k set
    c0 = to_markdown(tables["expected_c0_my-llama_test"])
    assert "| 0.500 | 0.610 |" in c0 and "WARNING" not in c0  # C_B's first-order prediction; no path there
    assert "its text quotes 1/γ from 0.37 to 0.50" in c0 and "top-k set that of the unscaled logits" in c0
    assert r"\|S_neg\|/\|S_pos\|" in md  # the pipes do not split the Markdown cell


def test_sweep_table_puts_the_papers_d_sweep_beside_ours():
    grid = grid_of(renamed_params())
    one = Grid(["my-llama"], ["tqa"], grid.model_keys, grid.dataset_keys)
    results = {("my-llama", "tqa"): {1: entry(0.80), 256: entry(0.92), 64: entry(0.91)}}
    t = sweep_table("detectors.max.dim", results, one)
    md = to_markdown(t)
    assert [r.label for r in t.rows] == ["1", "64", "256"]
    assert "| 256 | **0.920** ± 0.005 L2 (0.924) |" in md and "| 1 | 0.800 ± 0.005 L2 (0.833) |" in md
    other = sweep_table("detectors.max.lr", {("my-llama", "tqa"): {0.001: entry(0.8)}}, one)
    assert "(" not in to_markdown(other).split("\n")[4]  # no paper figure for another parameter


def test_load_metrics_names_what_is_missing(tmp_path):
    (tmp_path / "eval" / "m" / "d").mkdir(parents=True)
    (tmp_path / "eval" / "m" / "d" / "max.json").write_text(json.dumps(entry()))
    (tmp_path / "eval" / "m" / "d" / "p_sem.json").write_text(json.dumps(entry(family="baseline")))
    metrics = load_metrics(tmp_path / "eval", ["m"], ["d"], ["max", "p_sem"])
    assert set(metrics) == {("m", "d", "max"), ("m", "d", "p_sem")}
    with pytest.raises(FileNotFoundError, match=r"m/d/length.json"):
        load_metrics(tmp_path / "eval", ["m"], ["d"], ["max", "length"])


def test_report_stage_writes_one_md_and_tex_per_table(tmp_path):
    data = renamed_params()
    data["grid"] |= {
        "models": ["my-llama"],
        "datasets": ["tqa"],
        "detectors": ["hami", "max", "p_sem", "p_true"],
        "analyze": ["hami"],
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data))
    cost = {"needs": ["sampling", "a forward pass"], "seconds": 0.0123, "samples_per_s": 81.3}
    (tmp_path / "eval" / "my-llama" / "tqa").mkdir(parents=True)
    (tmp_path / "eval" / "my-llama" / "tqa" / "p_true.json").write_text(
        json.dumps(entry(0.61, family="baseline", cost_per_response=cost))
    )
    for method in ("hami", "max"):
        path = tmp_path / "eval" / "my-llama" / "tqa" / f"{method}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(trained(method)))
    (tmp_path / "eval" / "my-llama" / "tqa" / "p_sem.json").write_text(json.dumps(entry(family="baseline")))
    cls = {"n": 10, "p_sem": 0.5, "c": -2.0, "p_sem_c": -1.0}
    mean = {"neg": cls, "pos": cls, "gamma": 1.0, "inv_gamma": 1.0, "class_ratio": 1.0, "condition_holds_seeds": [0, 0]}
    analysis = tmp_path / "eval" / "my-llama" / "tqa" / "analysis" / "hami.json"  # beside evaluate's metrics
    analysis.parent.mkdir()
    analysis.write_text(
        json.dumps(
            {
                "best_layer": 3,
                "lam": 1.0,
                "layers": {"3": {s: {"mean": {"c0": mean, "c_int": mean}} for s in ("train", "test")}},
            }
        )
    )
    (tmp_path / "labels" / "my-llama").mkdir(parents=True)
    (tmp_path / "labels" / "my-llama" / "tqa.json").write_text(
        json.dumps(
            {
                "splits": {
                    "train": {"hallucinated": 996, "correct": 2874},
                    "test": {"hallucinated": 1257, "correct": 4097},
                }
            }
        )
    )
    # the evidence stage's JSON of the cell (tests/report/test_evidence_tables.py has the full format)
    q = {"median": 2.0, "q25": 1.0, "q75": 3.0}
    classes = {
        "n": 5,
        "n_with_positive_evidence": 5,
        "median_T": 8.0,
        "s50": q,
        "s90": q,
        "s50_share": q,
        "s90_share": q,
    }
    (tmp_path / "evidence" / "my-llama").mkdir(parents=True)
    (tmp_path / "evidence" / "my-llama" / "tqa.json").write_text(
        json.dumps(
            {
                "methods": {
                    "max": {
                        "display": "Max pooling",
                        "layer": 2,
                        "evidence": "...",
                        "classes": {"hallucinated": classes, "correct": classes},
                    }
                }
            }
        )
    )
    # prepare's leak check: tqa's prompts hold their answer for half the questions (above report.leak_threshold)
    (tmp_path / "prepare").mkdir()
    (tmp_path / "prepare" / "tqa.json").write_text(json.dumps({"leak": {"prompt_fraction": 0.5}}))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "stages.report",
            "--params",
            str(tmp_path / "params.yaml"),
            "--metrics-dir",
            str(tmp_path / "eval"),
            "--labels-dir",
            str(tmp_path / "labels"),
            "--evidence-dir",
            str(tmp_path / "evidence"),
            "--prepare-dir",
            str(tmp_path / "prepare"),
            "--out-dir",
            str(tmp_path / "tables"),
            "--summary",
            str(tmp_path / "summary.json"),
            "--headline-dir",
            str(tmp_path / "headline"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    names = {p.name for p in (tmp_path / "tables").iterdir()}
    for table in (
        "auroc",
        "margin",
        "throughput",
        "p_sem_auroc",
        "label_distribution",
        "detection_prr",
        "margin_by_length",
        "expected_c_int_my-llama_test",
        "margin_growth",
        "training_time",
        "evidence_sparsity",
    ):
        assert {f"{table}.md", f"{table}.tex"} <= names, table
    growth = (tmp_path / "tables" / "margin_growth.md").read_text()
    assert "| Max pooling | 9.90 0.1 → 10, rose in 100% of epochs |" in growth
    times = (tmp_path / "tables" / "training_time.md").read_text()
    assert "| Max pooling | 12.5 L2; all 5 layers 60 s |" in times and "recipe paper, 100 epochs, batch 128" in times
    assert "LLaMA-3.1-8B 140 s" in times  # the paper's appendix total, in the notes
    labels = (tmp_path / "tables" / "label_distribution.md").read_text()
    assert "| my-llama / tqa [leak] / test | 1,257 (1257) | 4,097 (4097) | 3.26 (3.26) |" in labels
    # p(True) (a score with nothing to train) in the block of the field's baselines, under the paper's methods
    main = (tmp_path / "tables" / "auroc.md").read_text()
    assert "| p(True) [sampling, a forward pass] | <u>0.610</u> ± 0.005 [0.590, 0.630] 12.3 ms/resp. |" in main
    assert main.index("| Max pooling |") < main.index("| p(True) [")
    assert "| my-llama / tqa [leak] |" in main and "- [leak]: the prompt the model sees" in main
    assert (
        "| p(True) [sampling, a forward pass] | <u>81.3</u> 12.3 ms/resp. |"
        in (tmp_path / "tables" / "throughput.md").read_text()
    )
    assert "0.800" in (tmp_path / "tables" / "p_sem_auroc.md").read_text()
    assert json.loads((tmp_path / "summary.json").read_text())["my-llama/tqa/max"]["test_prr"] == 0.5
    assert "n/a: E[P_sem C] <= 0" in (tmp_path / "tables" / "expected_c_int_my-llama_test.md").read_text()


@pytest.mark.skipif(__import__("shutil").which("pdflatex") is None, reason="pdflatex is not installed")
def test_every_table_compiles_with_latex(tmp_path):
    """The real check of the escaping: pdflatex accepts every table, a caption and cells made of
    nothing but special characters included."""
    grid = grid_of(renamed_params())
    methods = ("hami", "hami_sp", "mean", "max", "raw_mean", "raw_max", "attention", "gated_attention")
    metrics = {
        (m, "tqa", method): trained(
            method, cost={"samples_per_s_with_sampling_and_nli": 177.0, "sequential_samples_per_s": 0.3}
        )
        for m in ("my-llama", "world")
        for method in methods
    }
    metrics |= {(m, "tqa", "p_sem"): entry(family="baseline") for m in ("my-llama", "world")}
    tables = build_tables(metrics, grid)
    special = r"a_b & 50% $x #1 {y} ~z ^w \n <a> |b| ± × ≤ ≥ γ λ – — … é"  # an odd $ too
    tables.append(
        Table(
            "special",
            special,
            special,
            [(special, [special])],
            [Row(special, [Cell(1.0, note=special)])],
            notes=[special],
        )
    )
    res = pdflatex(tables, tmp_path)
    assert res.returncode == 0, res.stdout[-2000:]
