"""Teacher-forced hidden states of the selected layers, one HDF5 file per layer.

Data-parallel like `generate`: with `HALLUDETECT_PROCESSES=N` each process writes a
contiguous block of batches and process 0 joins the blocks in order, so the files are the
same as a one-process run's. An interrupted dump leaves no output (everything is written
under a temporary name first); re-running starts it again.

The same pass recomputes every answer token's log-prob from the weights and compares it with
the generations' (`dump.logprob_check`): answers sampled by another model, revision, tokenizer
or logprob mode stop the dump with the largest difference.
"""

import shutil
from pathlib import Path

from halludetect.activations.capture import dump
from halludetect.activations.layer_writer import merge_parts
from halludetect.activations.logprob_check import LogprobCheck
from halludetect.core.artifacts import read_parquet
from halludetect.core.atomic_io import atomic_path
from halludetect.core.errors import UserError
from halludetect.lm.hf_models import check_layers, load_config, load_model, load_tokenizer
from halludetect.lm.parallel import relaunch, workers
from halludetect.prompts import GENERATION, template_hash
from halludetect.qa.questions import read_questions
from halludetect.qa.responses import select_answers
from stages import common


def run(args, params):
    me = workers()
    preset = params.model(args.model)
    me.check_placement(args.model, preset)
    # Check the layers against the config before any weights are loaded.
    layers = check_layers(params.dump.layers, load_config(preset))
    selected, excluded = select_answers(read_parquet(args.generations, "generate", "generations table"))
    if excluded["empty_answer"] and me.main:
        common.log.warning("excluded %d empty answers (no tokens, no bag)", excluded["empty_answer"])
    if params.dump.source == "engine":  # the states the server kept while it sampled: no model here
        return run_engine(args, params, preset, layers, selected, excluded)
    tokenizer = load_tokenizer(preset)
    model = load_model(preset, me.device or params.dump.device)
    attrs = attributes(params, preset, excluded)
    tolerances = params.dump.logprob_check
    check = LogprobCheck(
        f"models.{args.model} ({preset.path}{f' at revision {preset.revision}' if preset.revision else ''})",
        tolerances.mean_tolerance,
        tolerances.answer_tolerance,
        tolerances.answer_share,
    )
    kw = dict(
        check=check,
        positions=params.dump.positions,
        dtype=params.dump.dtype,
        batch_size=params.dump.batch_size,
        attrs=attrs,
        chat_template=preset.chat_template,
        workers=me,
        log=common.log.info,
    )
    questions = read_questions(args.questions)
    out = Path(args.out)
    if me.size == 1:
        with atomic_path(out, is_dir=True) as tmp:
            dump(model, tokenizer, questions, selected, tmp, layers, **kw)
        return
    parts = out.parent / f".{out.name}.parts"  # shared by the processes; removed at the end
    if me.main:
        shutil.rmtree(parts, ignore_errors=True)
    me.barrier()
    mine = parts / f"rank_{me.rank:03d}"
    mine.mkdir(parents=True)
    dump(model, tokenizer, questions, selected, mine, layers, **kw)
    me.barrier()
    if me.main:
        with atomic_path(out, is_dir=True) as tmp:
            merge_parts([parts / f"rank_{r:03d}" for r in range(me.size)], tmp, layers)
        shutil.rmtree(parts)


def attributes(params, preset, excluded: dict) -> dict:
    return {
        "model": preset.path,
        "revision": preset.revision or "",
        "positions": params.dump.positions,
        "dtype": params.dump.dtype,
        "prompt_hash": template_hash(GENERATION),
        "excluded_empty_answers": excluded["empty_answer"],
    }


def run_engine(args, params, preset, layers, selected, excluded):
    """dump.source engine (halludetect/activations/engine_dump.py): one process reads the kept states."""
    from halludetect.activations.engine_dump import FinalHead, check_engine_layers, dump_engine
    from halludetect.lm.engine_states import AnswerStates, states_dir

    me = workers()
    if me.size > 1:
        raise UserError("dump.source engine reads files in one process: unset HALLUDETECT_PROCESSES")
    config = load_config(preset).get_text_config()
    top, tolerances = int(config.num_hidden_layers), params.dump.logprob_check
    checked = tolerances.mean_tolerance is not None or tolerances.answer_tolerance is not None
    states = AnswerStates(states_dir(args.generations))
    first = selected.row(0, named=True) if selected.height else None
    engine_layers = states.load(first["question_id"], first["sample_index"])[1] if first else []
    check_engine_layers(layers, engine_layers, top, checked)  # the server's layers, as its files say
    head = FinalHead(preset) if checked or top in layers else None
    check = None
    if checked:
        check = LogprobCheck(
            f"models.{args.model} ({preset.path}{f' at revision {preset.revision}' if preset.revision else ''})",
            tolerances.mean_tolerance,
            tolerances.answer_tolerance,
            tolerances.answer_share,
        )
    with atomic_path(Path(args.out), is_dir=True) as tmp:
        dump_engine(
            selected,
            states,
            tmp,
            layers,
            top=top,
            hidden=int(config.hidden_size),
            positions=params.dump.positions,
            dtype=params.dump.dtype,
            batch_size=params.dump.batch_size,
            attrs={**attributes(params, preset, excluded), "source": "engine"},
            head=head,
            check=check,
            log=common.log.info,
        )


if __name__ == "__main__":
    relaunch("stages.dump")
    p = common.parser(__doc__)
    p.add_argument("--model", required=True, help="model preset name")
    p.add_argument("--questions", required=True, help="questions Parquet")
    p.add_argument("--generations", required=True, help="generations Parquet")
    p.add_argument("--manifest", required=True, help="model manifest; a dependency only")
    p.add_argument("--out", required=True, help="output directory of layer_XX.h5 files")
    common.main(run, p)
