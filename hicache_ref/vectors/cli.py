"""``hicache-fuzz vectors``: generate a suite, replay one on an implementation, write the schema.

hicache-fuzz vectors generate [--seed S] [--out DIR]          # writes DIR/v1.jsonl.gz, prints coverage
hicache-fuzz vectors replay [--impl NAME] [SUITE] [--json FILE] [--only ID ...] [--device cuda]
hicache-fuzz vectors schema [--out FILE]                      # the JSON Schema of a suite's lines

``replay`` prints one line per vector (PASS, FAIL with the invariant id, the step, expected and
got, or SKIP with the reason), then ``N vectors, N passed, N failed``; exit 0 when none failed,
1 when one did, 2 on bad input (a tampered or malformed suite, an unknown implementation, a
contract break: one line).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hicache_ref.campaign.cli_inputs import check_out_dir, check_output_file, check_sglang_src
from hicache_ref.errors import HiCacheInputError
from hicache_ref.harness.world.world import DEVICE_KINDS
from hicache_ref.replay_lines import get_vector_line

EXIT_OK, EXIT_FAILED = 0, 1


def add_vectors_parser(sub: Any) -> None:
    """Add ``vectors`` and its three subcommands to the CLI's subparsers."""
    vectors = sub.add_parser("vectors", help="conformance vectors: generate, replay, schema")
    actions = vectors.add_subparsers(dest="vectors_command", parser_class=type(vectors))
    gen = actions.add_parser("generate", help="write a suite from the reference and the oracle")
    gen.add_argument("--seed", type=int, default=None, help="default: the shipped suite's seed")
    gen.add_argument("--out", default="fuzz/vectors", help="folder for v1.jsonl.gz")
    gen.add_argument("--json", metavar="FILE", help="write the coverage table as JSON here")
    gen.set_defaults(func=cmd_generate)
    rep = actions.add_parser("replay", help="replay a suite on an implementation")
    rep.add_argument("suite", nargs="?", default=None, help="default: the shipped suite")
    rep.add_argument("--impl", default="reference", help="a name, or pkg.module:factory")
    rep.add_argument(
        "--sglang-src",
        metavar="DIR",
        help="as for run: the unpacked sglang tree --impl sglang / seed reads",
    )
    rep.add_argument(
        "--device",
        default="sim",
        choices=DEVICE_KINDS,
        help="sim (default) or cuda: where to replay",
    )
    rep.add_argument("--only", nargs="+", metavar="ID", help="replay only these vector ids")
    rep.add_argument("--json", metavar="FILE", help="write a machine-readable report here")
    rep.add_argument("--quiet", action="store_true", help="print only failures and the total")
    rep.set_defaults(func=cmd_replay)
    schema = actions.add_parser("schema", help="print (or write) the suite's JSON Schema")
    schema.add_argument("--out", metavar="FILE", help="write it here instead of stdout")
    schema.set_defaults(func=cmd_schema)
    vectors.set_defaults(func=lambda args: _usage(vectors))


def _usage(parser: argparse.ArgumentParser) -> int:
    raise HiCacheInputError(f"{parser.prog} needs a command: generate, replay or schema")


def cmd_generate(args: argparse.Namespace) -> int:
    from hicache_ref.vectors.generate import DEFAULT_SEED, generate_suite
    from hicache_ref.vectors.suite import SHIPPED_SUITE, write_suite

    out = check_out_dir("--out", args.out)
    if args.json:
        check_output_file("--json", args.json)
    seed = DEFAULT_SEED if args.seed is None else args.seed
    result = generate_suite(seed, progress=_progress)
    path = write_suite(out / SHIPPED_SUITE, result.header, result.vectors)
    ids = _invariant_ids()
    print(file=sys.stderr)
    print(result.coverage.render(ids))
    kinds = {k: sum(v.kind == k for v in result.vectors) for k in ("story", "generated", "oracle")}
    print(
        f"suite {result.header.suite} (seed {seed}): {len(result.vectors)} vectors "
        f"({', '.join(f'{n} {k}' for k, n in kinds.items())}), digest "
        f"{result.header.digest[:16]}..., {path.stat().st_size} bytes: {path}"
    )
    if args.json:
        table = {rule: dict(row) for rule, row in result.coverage.table.items()}
        Path(args.json).write_text(json.dumps({"rules_x_ids": table}, indent=2) + "\n")
    missing = result.coverage.missing_rules() + result.coverage.missing_ids(ids)
    return EXIT_FAILED if missing else EXIT_OK


def _progress(count: int) -> None:
    if count % 50 == 0:
        print(f"  {count} vectors", end="\r", file=sys.stderr, flush=True)


def _invariant_ids() -> list[str]:
    from hicache_ref.vectors.coverage import INVARIANT_IDS

    return list(INVARIANT_IDS)


def cmd_replay(args: argparse.Namespace) -> int:
    from hicache_ref.harness.adapters.registry import checked_implementation
    from hicache_ref.vectors.replay import replay_vectors
    from hicache_ref.vectors.suite import read_suite, shipped_suite_path

    if args.json:
        check_output_file("--json", args.json)
    source = str(check_sglang_src(args.sglang_src)) if args.sglang_src else ""
    implementation = checked_implementation(args.impl, source)  # a contract break: exit 2
    _, vectors = read_suite(Path(args.suite) if args.suite else shipped_suite_path())
    if args.only:
        known = {v.id for v in vectors}
        unknown = [i for i in args.only if i not in known]
        if unknown:
            raise HiCacheInputError(f"--only: no vector {unknown[0]!r} in the suite")
        vectors = [v for v in vectors if v.id in set(args.only)]

    suite = Path(args.suite) if args.suite else shipped_suite_path()

    def show(result: Any) -> None:
        if not args.quiet or result.status == "fail":
            print(result.render(), flush=True)
        if result.status == "fail":  # one line that replays this vector alone, as printed
            print(f"  replay: {get_vector_line(args.impl, result.vector, suite, source)}")

    report = replay_vectors(vectors, implementation, args.impl, args.device, on_result=show)
    for reason, count in report.skip_reasons.items():
        print(f"skipped {count}: {reason}")
    print(report.closing_line())
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_json(), indent=2) + "\n")
    return EXIT_FAILED if report.count("fail") else EXIT_OK


def cmd_schema(args: argparse.Namespace) -> int:
    from hicache_ref.vectors.schema import schema_text

    if args.out:
        path = check_output_file("--out", args.out)
        path.write_text(schema_text())
        print(f"schema: {path}")
    else:
        print(schema_text(), end="")
    return EXIT_OK
