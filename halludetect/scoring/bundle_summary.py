"""`halludetect show`'s summary of a bundle, for a person: what it detects with, what it was
trained and measured on, how its default flag threshold was chosen and what it does, its
calibration, and what its input must be. `halludetect show --json` prints the raw metadata.

Figures a bundle does not record (an older format's) are said to be missing, never made up.
"""

from __future__ import annotations

import json
import textwrap

from halludetect.core.lookup import UnknownName
from halludetect.methods import method as lookup_method
from halludetect.scoring.answer_range import describe_range
from halludetect.scoring.bundle import RANGE_RULE, Bundle, ScoreBundle, p_sem_requirement

WIDTH = 13  # the labels' column


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _line(label: str, text: str) -> str:
    return f"{label:<{WIDTH}}{text}"


def _para(label: str, text: str) -> str:
    """A line of prose, wrapped at 100 columns under its label."""
    return textwrap.fill(text, 100, initial_indent=f"{label:<{WIDTH}}", subsequent_indent=" " * WIDTH)


def _more(text: str) -> str:
    return " " * WIDTH + text


def _model(base: dict) -> list[str]:
    name = f"{base['name']}: " if base.get("name") else ""
    if base.get("files"):
        pin = f"a local directory, pinned by the sha256 of its {len(base['files'])} files"
    elif base.get("resolved_revision"):
        pin = f"revision {base.get('revision') or 'main'}, resolved to commit {base['resolved_revision']}"
    else:
        pin = "no revision pinned"
    return [
        _line("base model", f"{name}{base['path']} ({pin})"),
        _more(f"{base['num_hidden_layers']} layers, hidden size {base['hidden_size']}"),
    ]


def _rule(name: str, entry: dict, unit: str = "logit") -> str:
    if name == "best_f1":
        return f"the validation {unit} of the best F1"
    target = entry.get("target_fpr")
    return f"the lowest validation {unit} whose false-positive rate is at most {_pct(target)}"


def _rates(entry: dict) -> str:
    val = f"validation FPR {_pct(entry.get('val_fpr'))}, TPR {_pct(entry.get('val_tpr'))}"
    if entry.get("test_fpr") is None:
        return f"{val}; test: not recorded (format 2: re-export the bundle)"
    return f"{val}; test FPR {_pct(entry['test_fpr'])}, TPR {_pct(entry['test_tpr'])}"


def _split(ev: dict, split: str) -> str:
    n, bad = ev.get(f"n_{split}"), ev.get(f"n_{split}_hallucinated")
    if n is None:
        return "answers not recorded"
    return f"{n:,} answers, {bad:,} hallucinated" if bad is not None else f"{n:,} answers"


def _thresholds(meta: dict, unit: str = "logit") -> list[str]:
    default = meta["default_threshold"]
    t = meta["thresholds"][default]
    out = [
        _line("threshold", f"{default} = {t['threshold']:.4g} (the default): {_rule(default, t, unit)}"),
        _more(_rates(t)),
        *(
            [_more("it flags no validation answer: no threshold that flags one stays within the rate")]
            if t.get("val_fpr") == 0.0 and t.get("val_tpr") == 0.0  # threshold_at_fpr's edge: above every score
            else []
        ),
        _more(f"flag = score >= threshold; --threshold NAME (or a {unit}) picks another:"),
        _more(f"  {'name':<10}{unit:>9}{'val FPR':>9}{'val TPR':>9}{'test FPR':>10}{'test TPR':>10}"),
    ]

    def order(name):  # the rates from the lowest, then best F1
        return (1, 0.0) if name == "best_f1" else (0, meta["thresholds"][name].get("target_fpr") or 0.0)

    for name in sorted(meta["thresholds"], key=order):
        e = meta["thresholds"][name]
        mark = "*" if name == default else " "
        out.append(
            _more(
                f"{mark} {name:<10}{e['threshold']:>9.4g}{_pct(e.get('val_fpr')):>9}{_pct(e.get('val_tpr')):>9}"
                f"{_pct(e.get('test_fpr')):>10}{_pct(e.get('test_tpr')):>10}"
            )
        )
    return out


def _calibration(cal: dict) -> str:
    return _line(
        "calibration",
        f"Platt: probability = sigmoid({cal['a']:.4g} score {'+' if cal['b'] >= 0 else '-'} {abs(cal['b']):.4g})"
        + (f", fitted on {cal['n']:,} validation answers" if "n" in cal else ", fitted on validation")
        + (f" (log loss {cal['val_log_loss']:.3f}, Brier {cal['val_brier']:.3f})" if "val_brier" in cal else "")
        + (
            "; the fit did not converge: the validation scores separate the classes, so its probabilities "
            "are near 0 or 1 and overconfident"
            if cal.get("converged") is False
            else ""
        ),
    )


# What `halludetect score` computes with a score bundle, per what it reads (score_bundle.ONE_ANSWER).
SCORE_INPUT = {
    "p_sem": "rows: question, answer, p_sem[, id]; the score is 1 - p_sem (no model runs)",
    "tokenizer": "rows: question, answer[, id, answer_token_ids]; the score is the answer's length in tokens "
    "under the base model's tokenizer (no weights load)",
    "model": "rows: question, answer[, id, answer_token_ids]; the score is minus the mean token log-prob of the "
    "answer under the base model, run teacher forced on the prompt below + the answer",
}


def score_summary_text(b: ScoreBundle) -> str:
    """The readable summary of a score bundle: the score, what it was measured on, its thresholds
    and calibration (on the score's own scale), what `score` computes it from, or why it cannot."""
    meta = b.meta
    decl, ev, rng, inputs = meta["score"], meta["evaluation"], meta["score_range"], meta["inputs"]
    params = ", ".join(f"{k} {v}" for k, v in sorted(meta["params"].items())) or "none"
    unscored = ", ".join(f"{n:,} {split}" for split, n in ev["unscored"].items() if n) or "none"
    lines = [
        _line(
            "bundle", f"{b.path} (score bundle, format {meta['format_version']}, sha256 {(b.sha256 or '?')[:16]}...)"
        ),
        _line("score", f"{decl['name']} ({decl['display']}): nothing trained, higher = more likely hallucinated"),
        _more(f"params: {params}; needs beyond the answer: {', '.join(decl['needs']) or 'nothing'}"),
        *_model(meta["base_model"]),
        _para(
            "measured on",
            f"model '{meta['model']}', dataset '{meta['dataset']}'; validation chose the thresholds and the "
            f"calibration; answers left out unscored: {unscored}",
        ),
        _line("validation", f"{_split(ev, 'val')}: AUROC {ev['val_auroc']:.3f}"),
        _line("test", f"{_split(ev, 'test')}: AUROC {ev['test_auroc']:.3f}"),
        *_thresholds(meta, "score"),
        _calibration(meta["calibration"]),
        _line("range", f"validation scores from {rng['min']:.4g} to {rng['max']:.4g}: a row is {RANGE_RULE}"),
    ]
    if (refusal := b.refusal()) is not None:
        lines.append(_para("input", refusal))
    else:
        lines.append(_para("input", SCORE_INPUT[b.reads]))
        if b.reads == "model":
            chat = "yes" if inputs["chat_template"] else "no"
            lines.append(_more(f"prompt {json.dumps(inputs['prompt_template'])} (chat template: {chat})"))
    if needs := p_sem_requirement(meta):
        lines.append(_more(f"needs {needs}"))
    return "\n".join(lines)


def summary_text(b: Bundle | ScoreBundle) -> str:
    """The readable summary of a loaded bundle (its metadata already checked by `load_bundle`)."""
    if isinstance(b, ScoreBundle):
        return score_summary_text(b)
    meta = b.meta
    ev, inputs, cal = meta["evaluation"], meta["inputs"], meta["calibration"]
    origin = meta.get("origin")
    try:
        display = lookup_method(meta["method"]).display
    except UnknownName:  # a plugin not registered here: `show` summarises the metadata without it
        display = "a plugin's method, not registered here"
    seeds = ", ".join(map(str, meta["seeds"]))
    top = meta["n_layers"]
    where = {0: "the embeddings", top: "the top, after the final norm"}.get(meta["layer"], "a middle block's output")
    positions = {
        "predicting": "each answer token's state is read at the position that predicted it",
        "generated": "each answer token's state is read at the token itself",
    }[inputs["positions"]]
    per_seed = ev.get("test_auroc_dag") or {}
    seed_auroc = (
        f", {per_seed['mean']:.3f} ± {per_seed['stderr']:.3f} per seed (mean ± SE)" if "stderr" in per_seed else ""
    )
    chat = "yes" if inputs["chat_template"] else "no"
    lines = [
        _line("bundle", f"{b.path} (format {meta['format_version']}, sha256 {(b.sha256 or '?')[:16]}...)"),
        _line("detector", f"{meta['method']} ({display}): the mean logit of {len(meta['seeds'])} seeds ({seeds})"),
        *([_more(f"from the plugin factory {origin['factory']} ({origin['via']})")] if origin else []),
        *_model(meta["base_model"]),
        _line("layer", f"{meta['layer']} of {top} ({where})"),
        _line("positions", f"{inputs['positions']}: {positions}"),
        _para(
            "trained on",
            f"dataset '{ev.get('dataset') or '?'}', its train split (its size is not recorded in the bundle); "
            f"validation chose the epoch, the layer ({ev.get('layer_selection', 'highest mean validation AUROC')}) "
            "and the thresholds",
        ),
        _line("validation", f"{_split(ev, 'val')}: AUROC {ev['val_auroc_ensemble']:.3f} (the seeds' mean logit)"),
        _line(
            "test", f"{_split(ev, 'test')}: AUROC {ev['test_auroc_ensemble']:.3f} (the seeds' mean logit){seed_auroc}"
        ),
        *_thresholds(meta),
        _calibration(cal),
        _para(
            "input",
            "the base model's own answers: sampled from this model with the prompt below. Text written "
            "elsewhere (typed by hand, another model's) is out of its distribution: its score means little",
        ),
        _more(f"prompt {json.dumps(inputs['prompt_template'])} (chat template: {chat})"),
        _more("rows: question, answer[, id, answer_token_ids" + (", p_sem]" if p_sem_requirement(meta) else "]")),
        _para("distribution", describe_range(meta.get("answer_range"))),
    ]
    needs = p_sem_requirement(meta)
    if needs:
        lines.append(_more(f"needs {needs}"))
    return "\n".join(lines)
