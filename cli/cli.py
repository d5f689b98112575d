"""`kiln`: one console script, one subcommand per job.

    kiln operator   the kopf operator (operator Deployment)
    kiln build      build one engine and publish it into the cache (build Job)
    kiln serve      serve a cached engine over the Open Inference Protocol (runtime pod)
    kiln dev        build and serve an InferenceModel manifest on this machine
    kiln rollout    show, promote or abort an InferenceModel's canary rollout

Each subcommand's implementation is imported only when it runs, so the operator image
needs neither ONNX Runtime nor TensorRT, and the runtime image needs no kopf.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kiln import __version__

# subcommand -> module with `configure(parser)` and `run(args) -> int`.
# configure() must not import heavy dependencies: it runs for every `kiln --help`.
SUBCOMMANDS = {
    "operator": "kiln.operator.main",
    "build": "kiln.runtime.build",
    "serve": "kiln.runtime.serve",
    "dev": "kiln.runtime.dev",
    "rollout": "kiln.operator.rollout_cli",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description="GPU inference on Kubernetes.")
    p.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            # One subcommand missing from an image (or a checkout) must not break the others.
            sp = sub.add_parser(name, help=f"(unavailable here: {e})", add_help=False)
            sp.add_argument("rest", nargs=argparse.REMAINDER)
            sp.set_defaults(_module=None, _import_error=f"kiln {name} is unavailable here: {e}")
            continue
        sp = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0],
                            description=(mod.__doc__ or "").strip())
        mod.configure(sp)
        sp.set_defaults(_module=mod)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args._module is None:
        print(args._import_error, file=sys.stderr)
        return 1
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
