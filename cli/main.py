"""The `hybridkv` command."""

from __future__ import annotations

import argparse
import sys

from hybridkv.cli import agentic_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridkv", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    mirror = sub.add_parser(
        "mirror-demo", help="store mirror + dense reference on a real mooncake_master"
    )
    mirror.add_argument("--turns", type=int, default=4)
    mirror.add_argument("--seed", type=int, default=0)
    tiny = sub.add_parser("tiny-model", help="write a tiny hybrid model (seeded random weights)")
    tiny.add_argument("kind")
    tiny.add_argument("out_dir")
    tiny.add_argument("--seed", type=int, default=0)
    agent = sub.add_parser(
        "demo",
        help="replay a multi-turn agentic session on a vLLM server; check hits vs recompute",
        description=agentic_demo.__doc__.split("\n\n")[0],
    )
    agentic_demo.add_arguments(agent)
    from hybridkv.cli import proxy

    proxy.add_arguments(
        sub.add_parser("proxy", help="OpenAI-compatible P/D front door (prefill -> decode)")
    )
    from hybridkv.cli import doctor

    doctor.add_arguments(
        sub.add_parser(
            "doctor",
            help="check a --kv-transfer-config, the installed stack and a model before starting vLLM",
            description=doctor.__doc__.split("\n\n")[0],
        )
    )
    from hybridkv.cli import grafana

    grafana.add_arguments(
        sub.add_parser(
            "grafana", help="print a Grafana dashboard (JSON) of hybridkv's metrics next to vLLM's"
        )
    )
    args = parser.parse_args(argv)
    if args.cmd == "grafana":
        return grafana.run_from_args(args)
    if args.cmd == "doctor":
        return doctor.run_from_args(args)
    if args.cmd == "proxy":
        return proxy.run_from_args(args)
    if args.cmd == "mirror-demo":
        from hybridkv.cli.harness.mirror_demo import run_demo

        return run_demo(turns=args.turns, seed=args.seed)
    if args.cmd == "demo":
        return agentic_demo.run_from_args(args)
    from hybridkv.cli.harness.tiny_models import write_tiny_model

    print(write_tiny_model(args.kind, args.out_dir, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
