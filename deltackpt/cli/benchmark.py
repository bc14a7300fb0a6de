"""The workload benchmark users run: ``deltackpt bench`` (the harness is ``deltackpt.bench``)."""

from __future__ import annotations

from .options import parse_pairs
from .output import emit
from .status import EXIT_OK, EXIT_PROBLEMS


def register(add) -> None:
    sp = add("bench", cmd_bench, "workload benchmark: DCP vs deltackpt vs ZipNN vs restic on real training runs")
    sp.add_argument("--quick", action="store_true", help="small sizes, dense/frozen/sparse only (< 3 min)")
    sp.add_argument("--out", default="bench-out/workloads", help="output directory (default bench-out/workloads)")
    sp.add_argument("--workloads", help="comma-separated: dense,dense100,frozen,frozen-base,sparse,bf16,reshard "
                    "(frozen-base: the frozen run with its base model saved first)")
    sp.add_argument("--systems", help="comma-separated: dcp,deltackpt,zipnn,restic (dcp always runs)")
    sp.add_argument("--store-config", action="append", metavar="KEY=VALUE",
                    help="deltackpt StoreConfig override, e.g. chunk_size_bytes=262144 (repeatable)")
    sp.add_argument("--variant", action="append", metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
                    help="also run deltackpt with these StoreConfig overrides as system deltackpt-LABEL (repeatable)")
    sp.add_argument("--restic-compression", default="auto", choices=["auto", "max", "off"])
    sp.add_argument("--page-cache", default="warm", choices=["warm", "drop"],
                    help="before each load: read the files once (warm) or drop the page cache (root)")
    sp.add_argument("--keep", action="store_true", help="keep the checkpoints written under --out")
    sp.add_argument("--checkpoints", type=int, metavar="N",
                    help="checkpoints per workload (default 10; 4 with tiny sizes)")


def cmd_bench(args) -> int:
    from ..bench import FULL_WORKLOADS, QUICK_WORKLOADS, run_bench
    from ..bench.report import markdown

    names = args.workloads.split(",") if args.workloads else list(QUICK_WORKLOADS if args.quick else FULL_WORKLOADS)
    variants = {}
    for spec in args.variant or []:
        label, _, pairs = spec.partition(":")
        variants[label] = parse_pairs(pairs.split(",") if pairs else [], "--variant")
    results = run_bench(args.out, [n.strip() for n in names if n.strip()], size="quick" if args.quick else "full",
                        systems=args.systems.split(",") if args.systems else ("dcp", "deltackpt", "zipnn", "restic"),
                        store_config=parse_pairs(args.store_config, "--store-config"), variants=variants,
                        restic_compression=args.restic_compression, page_cache=args.page_cache, keep=args.keep,
                        num_checkpoints=args.checkpoints)
    emit(args, results, lambda: markdown(results) + f"\nwritten: {args.out}/results.json, results.md, "
                                                    "cumulative_bytes.png")
    bad = [f"{w}/{s}" for w, e in results["workloads"].items() for s, r in e["systems"].items()
           if "error" in r or not r.get("load_bit_exact")]
    return EXIT_PROBLEMS if bad else EXIT_OK
