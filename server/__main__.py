"""`python -m server [flags]`: the same as `vkengine serve`, for a source tree
that is not installed (the vkengine CLI finds `serve` through package metadata)."""
import argparse
import sys

from vkengine.cli import run
from vkengine.options import add_model_args

from .options import add_serve_args, serve


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m server", description="vkengine's HTTP server (= vkengine serve)")
    add_model_args(ap)
    add_serve_args(ap)
    ap.set_defaults(fn=serve)
    return run(ap, argv)


if __name__ == "__main__":
    sys.exit(main())
