"""Sample K answers per question with prompt 1, recording token ids and log-probabilities."""

from halludetect import cli
from halludetect.datasets import read_questions
from halludetect.generation import generate
from halludetect.io import write_parquet
from halludetect.modeling import load_model, load_tokenizer


def run(args, params):
    preset = params.model(args.model)
    questions = read_questions(args.questions)
    tokenizer = load_tokenizer(preset)
    model = load_model(preset, params.generate.device)
    df = generate(model, tokenizer, questions, params.generate, chat_template=preset.chat_template)
    write_parquet(args.out, df)
    empty = int((df["n_tokens"] == 0).sum())
    cli.log.info("generated %d answers (%d empty) for %d questions", df.height, empty, questions.height)


if __name__ == "__main__":
    p = cli.parser(__doc__)
    p.add_argument("--model", required=True, help="model preset name")
    p.add_argument("--questions", required=True, help="questions Parquet (prepare output)")
    p.add_argument("--manifest", required=True, help="model manifest (model output); a dependency only")
    p.add_argument("--out", required=True, help="generations Parquet")
    cli.main(run, p)
