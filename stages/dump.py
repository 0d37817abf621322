"""Teacher-forced hidden states of the selected layers, one HDF5 file per layer."""

from pathlib import Path

import polars as pl

from halludetect import cli
from halludetect.activations import dump
from halludetect.datasets import read_questions
from halludetect.io import atomic_path
from halludetect.modeling import check_layers, load_config, load_model, load_tokenizer
from halludetect.prompts import GENERATION, template_hash
from halludetect.responses import select_answers


def run(args, params):
    preset = params.model(args.model)
    # Check the layers against the config before any weights are loaded.
    layers = check_layers(params.dump.layers, load_config(preset))
    selected, excluded = select_answers(pl.read_parquet(args.generations))
    if excluded["empty_answer"]:
        cli.log.warning("excluded %d empty answers (no tokens, no bag)", excluded["empty_answer"])
    tokenizer = load_tokenizer(preset)
    model = load_model(preset, params.dump.device)
    attrs = {"model": preset.path, "revision": preset.revision or "", "positions": params.dump.positions,
             "dtype": params.dump.dtype, "prompt_hash": template_hash(GENERATION),
             "excluded_empty_answers": excluded["empty_answer"]}
    with atomic_path(Path(args.out), is_dir=True) as tmp:
        dump(model, tokenizer, read_questions(args.questions), selected, tmp, layers,
             positions=params.dump.positions, dtype=params.dump.dtype, batch_size=params.dump.batch_size,
             attrs=attrs, chat_template=preset.chat_template, log=cli.log.info)


if __name__ == "__main__":
    p = cli.parser(__doc__)
    p.add_argument("--model", required=True, help="model preset name")
    p.add_argument("--questions", required=True, help="questions Parquet")
    p.add_argument("--generations", required=True, help="generations Parquet")
    p.add_argument("--manifest", required=True, help="model manifest; a dependency only")
    p.add_argument("--out", required=True, help="output directory of layer_XX.h5 files")
    cli.main(run, p)
