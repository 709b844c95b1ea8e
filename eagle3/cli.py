"""The `eagle3` console script: one entry point, one subcommand per service or job action (`python -m eagle3`)."""

import argparse
import logging
import sys

from eagle3 import demo, doctor, engine_eval, gpu_demo, prompts, retention
from eagle3 import jobs as jobs_cli
from services.trainer import cli as trainer_cli
from services.worker import cli as worker_cli
from shared.errors import Eagle3Error
from shared.settings import Settings, get_settings


def cmd_api(args: argparse.Namespace, settings: Settings) -> None:
    from services.producer.app import serve

    serve(settings)


def cmd_inference(args: argparse.Namespace, settings: Settings) -> None:
    from services.inference.reference.server import serve

    serve(settings)


def cmd_prepare_model(args: argparse.Namespace, settings: Settings) -> None:
    from shared.data.model_assets import resolve_model_path

    print(resolve_model_path(args.model))


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand."""
    parser = argparse.ArgumentParser(prog="eagle3", description="EAGLE-3 hidden-state factory")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("api", help="run the producer API").set_defaults(func=cmd_api)
    sub.add_parser("inference", help="run the reference inference server (EAGLE3_MODEL_PATH)").set_defaults(
        func=cmd_inference
    )
    p = sub.add_parser("prepare-model", help="convert the SmolLM2 wheel's GGUF into a cached HF folder, print its path")
    p.add_argument("model", nargs="?", default="smollm2")
    p.set_defaults(func=cmd_prepare_model)
    worker_cli.add_parsers(sub)
    jobs_cli.add_parsers(sub)
    retention.add_parsers(sub)
    demo.add_parsers(sub)
    gpu_demo.add_gpu_arguments(sub.choices["demo"])
    trainer_cli.add_parsers(sub)
    engine_eval.add_engine_arguments(sub.choices["eval"])
    doctor.add_parsers(sub)
    prompts.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the progress bar
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        args.func(args, get_settings())
    except Eagle3Error as exc:
        sys.exit(f"error: {exc}")


if __name__ == "__main__":
    main()
