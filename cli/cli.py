"""`kiln`: one console script, one subcommand per job.

    kiln operator   the kopf operator (operator Deployment)
    kiln activator  hold requests for models scaled to zero (activator Deployment)
    kiln build      build one engine and publish it into the cache (build Job)
    kiln cache-gc   remove the engine-cache entries a plan names, orphans and debris (GC Job)
    kiln serve      serve a cached engine over the Open Inference Protocol (runtime pod)
    kiln dev        build and serve an InferenceModel manifest on this machine
    kiln rollout    show, promote or abort an InferenceModel's canary rollout

Each subcommand's implementation is imported only when it runs, so the operator image
needs neither ONNX Runtime nor TensorRT, and the runtime image needs no kopf. `kiln --help`
and every subcommand's --help work with the base install (`pip install kiln-operator`);
a subcommand whose extra is not installed says which one and exits 2:

    kiln dev needs the runtime extra: pip install 'kiln-operator[runtime]' (missing module jsonschema)

(`kiln build`, whose exit codes are the build Job's contract, exits 6, Unsupported.)
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kiln import __version__

# subcommand -> (module with `configure(parser)` and `run(args) -> int`, the extra it needs).
# configure() must not import heavy dependencies: it runs for every `kiln --help`.
SUBCOMMANDS = {
    "operator": ("kiln.operator.main", "operator"),
    "activator": ("kiln.activator.command", "operator"),
    "build": ("kiln.runtime.commands.build", "runtime"),
    "cache-gc": ("kiln.runtime.commands.cache_gc", "runtime"),
    "serve": ("kiln.runtime.commands.serve", "runtime"),
    "dev": ("kiln.runtime.commands.dev", "runtime"),
    "rollout": ("kiln.operator.rollout_cli", "operator"),
}
EXIT_MISSING_EXTRA = 2


def missing_extra(command: str, error: BaseException) -> str | None:
    """The line to print when `kiln COMMAND` failed for want of a module its extra installs;
    None when `error` is something else (a module of kiln itself missing is a bug)."""
    name = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
    if not name or name.split(".")[0] == "kiln":
        return None
    extra = SUBCOMMANDS[command][1]
    return (f"kiln {command} needs the {extra} extra: pip install 'kiln-operator[{extra}]' "
            f"(missing module {name.split('.')[0]})")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln", description="GPU inference on Kubernetes.")
    p.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, _) in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            # One subcommand missing from an image (or a checkout) must not break the others.
            message = missing_extra(name, e)
            sp = sub.add_parser(name, help=f"(unavailable here: {e})", add_help=False)
            sp.add_argument("rest", nargs=argparse.REMAINDER)
            sp.set_defaults(_module=None, _import_error=(message, EXIT_MISSING_EXTRA) if message
                            else (f"kiln {name} is unavailable here: {e}", 1))
            continue
        sp = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0],
                            description=(mod.__doc__ or "").strip())
        mod.configure(sp)
        sp.set_defaults(_module=mod)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args._module is None:
        message, code = args._import_error
        print(message, file=sys.stderr)
        return code
    try:
        return int(args._module.run(args) or 0)
    except ModuleNotFoundError as e:  # imported only when needed, so missing only now
        message = missing_extra(args.command, e)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return EXIT_MISSING_EXTRA


if __name__ == "__main__":
    sys.exit(main())
