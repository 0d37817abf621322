"""The detector table of docs/benchmarks.md and the README, from a built DAG (run in its root).

    python -m bench.world_figures world/world     # <model>/<dataset>

One Markdown row per trained method of metrics/eval/<model>/<dataset>/, then per score with nothing to train there:
test AUROC (mean ± standard error over seeds, the question-bootstrap interval), PRR, FPR at 95% TPR,
margin, best layer, cost per response.
"""

import json
import sys
from pathlib import Path

DISPLAY = {
    "hami": "`hami`",
    "mean": "`mean`",
    "max": "`max`",
    "raw_mean": "`raw_mean`",
    "raw_max": "`raw_max`",
    "attention": "`attention`",
    "gated_attention": "`gated_attention`",
    "probe": "`probe`",
    "saplma": "`saplma`",
    "eigenscore": "`eigenscore`",
    "hami_sp": "`hami_sp`",
    "sep_tbg": "`sep_tbg`",
    "sep_slt": "`sep_slt`",
}


def cost(c):
    s = c["seconds"]
    return f"{s * 1e6:.3g} µs" if s < 1e-3 else f"{s * 1e3:.3g} ms"


def row(name, d, seeds=True):
    t = d["test"]
    a = t["auroc"]
    ci = t.get("auroc_ci95")
    se = f" ± {a['stderr']:.3f}" if seeds and a.get("stderr") not in (None, 0) else ""
    ci = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
    m = t.get("margin")
    margin = (
        f"{m['mean']:.2f} ± {m['stderr']:.2f}"
        if m and m.get("stderr") is not None
        else (f"{m['mean']:.2f}" if m else "-")
    )
    return (
        f"| {name} | {a['mean']:.3f}{se}{ci} | {t['prr']['mean']:.3f} | {t['fpr_at_95_tpr']['mean']:.3f} | "
        f"{margin} | {d.get('best_layer', '-')} | {cost(d['cost_per_response'])} |"
    )


cell = sys.argv[1] if len(sys.argv) > 1 else "world/world"
ev = Path("metrics/eval") / cell
print(f"## {cell}")
print("| method | test AUROC [question bootstrap] | PRR | FPR at 95% TPR | margin | best layer | cost per response |")
print("|---|---|---|---|---|---|---|")
for m in DISPLAY:
    p = ev / f"{m}.json"
    if p.exists():
        print(row(DISPLAY[m], json.loads(p.read_text())))
for p in sorted(ev.glob("*.json")):  # the scores with nothing to train, after the trained methods
    d = json.loads(p.read_text())
    if d.get("family") == "baseline":
        extra = f" n={d['test']['n']} hall={d['test'].get('n_hallucinated')}" if p.stem == "p_true" else ""
        print(row(f"`{p.stem}`", d, seeds=False) + extra)
t = json.loads((ev / "max.json").read_text())["test"]
print("test answers", t["n"], "hallucinated", t["n_hallucinated"], "questions", t["bootstrap"]["questions"])
