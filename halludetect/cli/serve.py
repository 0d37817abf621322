"""`halludetect serve`: an OpenAI-compatible server whose every answer comes with its detector's score
(`halludetect.scoring.serve`)."""

from __future__ import annotations

import argparse

from halludetect.cli.score import add_model_options
from halludetect.core.errors import UserError


def _layer_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': layer ids separated by commas, e.g. 8,16,24,32") from None


def run(args) -> None:
    from halludetect.config import GenerateParams, load_params
    from halludetect.scoring.scorer import checked_generate
    from halludetect.scoring.serve import Limits, serve

    generate = load_params(args.params).generate if args.params else GenerateParams()
    if args.max_new_tokens is not None:
        generate = generate.model_copy(update={"max_new_tokens": args.max_new_tokens})
    limits = Limits(
        max_tokens=args.max_tokens_limit,
        max_n=args.max_n,
        max_batch=args.max_batch,
        max_concurrency=args.max_concurrency,
        max_request_bytes=args.max_request_bytes,
    )
    engine = None
    if args.engine:
        from halludetect.scoring.serve import EngineClient

        engine = EngineClient(
            args.engine,
            args.engine_model,
            args.engine_layers,
            api_key_env=args.engine_key_env,
            states_dir=args.engine_states_dir,
        )
    elif args.engine_layers or args.engine_model or args.engine_key_env or args.engine_states_dir:
        raise UserError(
            "--engine-layers, --engine-model, --engine-key-env and --engine-states-dir go with --engine URL"
        )
    serve(
        args.bundle,
        args.model,
        host=args.host,
        port=args.port,
        api_key_env=args.api_key_env,
        name=args.served_model_name,
        limits=limits,
        engine=engine,
        revision=args.revision,
        dtype=args.dtype,
        device=args.device,
        device_map=args.device_map,
        generate=checked_generate(generate),
        threshold=args.threshold,
        check_distribution=not args.no_distribution_check,
        select=None if args.select == "none" else args.select,
    )


def add(sub) -> None:
    s = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server (/v1/completions, /v1/chat/completions) that scores every answer",
        description="Sample answers with the bundle's base model and return each with its detector's score, "
        "probability, flag and threshold (each choice's `hallucination`), from the sampling pass's own states. "
        "The request's prompt (or one user message) is the question: it is wrapped in the prompt the detector "
        "was trained on. Ctrl-C or SIGTERM stops it.",
    )
    s.add_argument("--bundle", required=True, help="detector bundle (.safetensors)")
    add_model_options(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: any free port, printed)")
    s.add_argument(
        "--api-key-env",
        help="environment variable holding the key every request must send (Authorization: Bearer KEY); "
        "default: no key",
    )
    s.add_argument("--served-model-name", help="the `model` requests name (default: the bundle's base model path)")
    s.add_argument(
        "--params",
        help="a params file whose `generate` section sets the default sampling (a request's temperature, "
        "top_p, top_k, max_tokens, stop and seed override it)",
    )
    s.add_argument("--max-new-tokens", type=int, help="default answer length in tokens, when a request gives none")
    s.add_argument(
        "--threshold",
        help="flag threshold: best_f1, fpr_0.05, ... or a logit value (default: the bundle's default)",
    )
    s.add_argument("--max-tokens-limit", type=int, default=256, help="the most max_tokens a request may ask (256)")
    s.add_argument("--max-n", type=int, default=16, help="the most answers one request may ask (16)")
    s.add_argument(
        "--select",
        choices=["none", "best_of_n", "abstain"],
        default="none",
        help="for requests that give no 'select': best_of_n returns the lowest-score of the n answers; abstain "
        "returns a refusal where that one is flagged (costs n samples; python -m bench.select measures what it buys)",
    )
    s.add_argument("--max-batch", type=int, default=64, help="answers sampled together in one pass (64)")
    s.add_argument("--max-concurrency", type=int, default=64, help="requests in flight; more get 429 (64)")
    s.add_argument("--max-request-bytes", type=int, default=1 << 20, help="largest request body (1 MiB)")
    s.add_argument(
        "--engine",
        help="a vLLM server's URL (http://host:8000/v1) started with hidden-state extraction: answers are sampled "
        "there and scored from the states files it writes, no model loads here (docs/serving.md)",
    )
    s.add_argument(
        "--engine-layers",
        type=_layer_ids,
        help="with --engine: the layer ids it extracts (its eagle_aux_hidden_state_layer_ids, any order), e.g. 8,16",
    )
    s.add_argument(
        "--engine-states-dir",
        help="with --engine: where vLLM is asked to write each answer's states file (it must see the same path; "
        "started with allow_custom_save_path); default: a private directory under /dev/shm, removed at exit",
    )
    s.add_argument(
        "--engine-model", help="with --engine: its served model name (default: the bundle's base model path)"
    )
    s.add_argument("--engine-key-env", help="with --engine: the variable holding its key (vllm serve --api-key)")
    s.add_argument(
        "--no-distribution-check",
        action="store_true",
        help="leave every answer's in_distribution null (the check reads the answers' token log-probs)",
    )
    s.set_defaults(run=run)
