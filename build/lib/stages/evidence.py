"""Token evidence of one grid cell: how many tokens carry each detector's evidence, a few test
answers per method with their evidence highlighted, and Theorem 2's gradient-norm ratio from
training (halludetect/report/cell_evidence.py)."""

from halludetect.lm.hf_models import load_tokenizer
from halludetect.report.cell_evidence import evidence_cell
from stages import common


def run(args, params):
    evidence_cell(
        args.model,
        args.dataset,
        params.grid,
        params.train.seeds,
        load_tokenizer(params.model(args.model)),  # to decode the answers' tokens
        eval_dir=args.eval_dir,
        detectors_dir=args.detectors_dir,
        activations=args.activations,
        judgments=args.judgments,
        clusters=args.clusters,
        generations=args.generations,
        questions=args.questions,
        out=args.out,
        responses=args.responses,
        figures_dir=args.figures,
        log=common.log.info,
    )


if __name__ == "__main__":
    p = common.parser(__doc__)
    for flag, text in [
        ("--model", "model preset name"),
        ("--dataset", "dataset preset name"),
        ("--eval-dir", "directory of the cell's <method>.json evaluate metrics (the best layers)"),
        ("--detectors-dir", "directory of <method>/layer_LL/seed_S.safetensors (and gradient_ratio.json)"),
        ("--activations", "directory of the cell's layer_LL.h5 files"),
        ("--judgments", "judgments Parquet"),
        ("--clusters", "clusters Parquet (P_sem of the methods that read it)"),
        ("--generations", "generations Parquet (the answers' text and tokens)"),
        ("--questions", "questions Parquet"),
        ("--out", "the cell's evidence figures, JSON"),
        ("--responses", "per response, method and seed: s50, s90, T (Parquet)"),
        ("--figures", "directory of evidence.png, sparsity.png and gradient_ratio.png"),
    ]:
        p.add_argument(flag, required=True, help=text)
    common.main(run, p)
