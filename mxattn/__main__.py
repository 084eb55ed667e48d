"""Command line: `python -m mxattn {info,demo,bench}`."""

from __future__ import annotations

import sys

from .cli import ArgumentParser


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m mxattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, GPU, and which backends can run here (with the reason)")
    sub.add_parser("demo", help="MXFP8 attention forward+backward on the best backend, errors vs FP64/BF16",
                   add_help=False)
    sub.add_parser("bench", help="benchmark the triton backend against torch SDPA (CUDA)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "info":
        if rest:  # (demo and bench parse what follows them themselves)
            info.error(f"unrecognized arguments: {' '.join(rest)}")
        from .info import main as info_main
        return info_main()
    if args.command == "demo":
        from .demo import main as demo_main
        return demo_main(rest)
    from .bench import main as bench_main
    return bench_main(rest)


if __name__ == "__main__":
    sys.exit(main())
