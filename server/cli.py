"""``promptfcl`` command line.

promptfcl simulate [--strategy NAME] [--config FILE.toml] [--set key=value ...] [--out DIR]
promptfcl pretrain [--source fashion-mnist] [--epochs 2] [--set key=value ...]
                                       build the offline backbone (cached; skipped if present)
promptfcl resume DIR                   continue a run that was stopped (checkpoint in DIR)
promptfcl bench perf [--out DIR]       speed against the compute bound, scale, memory, bytes
promptfcl bench compare [--methods ..] every method on identical splits, seeds, heterogeneity
                                       (--parallel N: N runs at once; --ray-address ADDR: on a Ray cluster)
promptfcl bench paper-dims [--out DIR] one round per paper configuration at ViT-B/16 dimensions
promptfcl bench edge [--out DIR]       one client round at ViT-B/16 dimensions within a node's memory budget
promptfcl bench data-memory [--sizes ..] a client's peak memory as the dataset grows (data cache)
promptfcl bench robustness [--share ..] A_N with hostile clients under each defence (the defaults, norm filter,
                                       median, trimmed mean, Krum, Bulyan); worst case over the attacks per share
promptfcl show DIR                     print the result table of a finished run
promptfcl strategies                   list the available methods
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import shutil
import signal
import sys
import time as _time
from pathlib import Path
from typing import Any

from ..common.config.experiment import FAULTS, ConfigError, ExperimentConfig
from ..common.config.files import parse_overrides
from ..common.data.sources import DataError
from ..common.model.low_precision import PRECISIONS
from ..common.model.pretrain import pretrain
from ..common.model.weights import BackboneSpec, check_weights, checkpoint_path
from ..strategies.platform.run_checks import check_run, load_config
from ..strategies.registry import methods
from . import bench, checkpoint
from .app import setup_logging
from .audit import AuditSettings, audit_run
from .bench.common import interruptible_when_benchmarked
from .bench.edge import ROWS, accuracy
from .report import table
from .simulation import run_simulation

log = logging.getLogger("promptfcl")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="promptfcl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="run an experiment in Flower's Ray simulation")
    sim.add_argument("--strategy", help=f"one of: {', '.join(sorted(methods()))}")
    sim.add_argument("--config", help="TOML file of run-config keys (e.g. configs/*.toml)")
    sim.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)"
    )
    sim.add_argument("--out", help="output directory (default: out-dir of the config)")
    sim.add_argument("--supernodes", type=int, help="Flower nodes to start (default: clients per round)")
    sim.add_argument("--verbose", action="store_true", help="Flower's debug logging")
    pre = sub.add_parser("pretrain", help="pretrain the configured small ViT offline and cache it")
    pre.add_argument("--source", default="fashion-mnist", help="labelled dataset to pretrain on")
    pre.add_argument("--epochs", type=int, default=2)
    pre.add_argument("--config", help="TOML file of run-config keys (the architecture is taken from it)")
    pre.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    pre.add_argument("--force", action="store_true", help="rebuild even if a cached backbone exists")
    res = sub.add_parser("resume", help="continue a stopped run from the checkpoint in its output directory")
    res.add_argument("dir")
    res.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="only keys that do not change results (round-timeout, threads, device, "
        "ray-address, client-cpus, client-gpus)",
    )
    res.add_argument("--supernodes", type=int)
    res.add_argument("--verbose", action="store_true")
    bench = sub.add_parser("bench", help="benchmarks (they print figures)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    perf = bench_sub.add_parser(
        "perf", help="client speed vs compute bound, per-round cost vs population, memory, bytes"
    )
    perf.add_argument("--out", default="runs/bench-perf")
    perf.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    perf.add_argument("--populations", default="10,100,1000")
    perf.add_argument("--methods", default="", help="comma-separated (default: all)")
    edge = bench_sub.add_parser("edge", help="one client round at ViT-B/16 dimensions within a node's memory "
                                "budget, per backbone precision (writes edge.json)")
    edge.add_argument("--out", default="runs/bench-edge")
    edge.add_argument("--batch-size", type=int, default=64, help="the paper configuration's batch (HGP, HePCo, "
                      "Powder: 64; CODA-P, Fed-CPrompt, FPPL: 128)")
    edge.add_argument("--threads", type=int, default=1, help="torch threads of each client process")
    edge.add_argument("--rows", default="", help="comma-separated row names (default: all; none: no memory rows)")
    edge.add_argument("--accuracy-seeds", default="0,1", help="seeds of the offline A_N per backbone precision "
                      "(empty: none)")
    edge.add_argument("--precisions", default="fp32,int8,bf16", help="backbone precisions of the offline A_N")
    dims = bench_sub.add_parser(
        "paper-dims",
        help="one round of each paper configuration at the papers' model "
        "dimensions (random ViT-B/16 weights, stand-in data)",
    )
    dims.add_argument("--out", default="runs/bench-paper-dims")
    dims.add_argument("--configs", default="configs/*.toml", help="glob of paper configurations")
    dep = bench_sub.add_parser(
        "deploy",
        help="a loopback deployment (deploy/ scripts) against the same "
        "configuration simulated: round time and per-message start-up",
    )
    dep.add_argument("--out", default="runs/bench-deploy")
    dep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    dep.add_argument("--nodes", type=int, default=3, help="SuperNodes (one client each)")
    mem = bench_sub.add_parser("data-memory", help="a client's peak memory and first round as the dataset grows "
                               "(synthetic 224-px images; mapped data cache against in-memory decoding)")
    mem.add_argument("--out", default="runs/bench-data-memory")
    mem.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    mem.add_argument("--sizes", default="2000,8000", help="dataset sizes (images), comma-separated")
    rob = bench_sub.add_parser("robustness", help="A_N with a share of hostile clients, under each defence")
    rob.add_argument("--out", default="runs/bench-robustness")
    rob.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    rob.add_argument("--methods", "--method", default="", help="comma-separated methods (default: every method)")
    rob.add_argument("--attacks", default="poison,sign-flip,poison-under-filter,stats-scale,stats-shift,cov-inflate,"
                     "hist-forge", help="fault kinds (client/faults.py); statistics attacks only on methods that "
                     "upload statistics")
    rob.add_argument("--defences", default="off,on",
                     help="of: on (defended, the configured parameters), off (clean runs only: the undefended "
                     "reference), none, norm-filter, directed-clip1, median, trimmed-mean, krum, multikrum, bulyan "
                     "(server/bench/attacks.py)")
    rob.add_argument("--seeds", default="0,1")
    rob.add_argument("--share", default="0.2", help="shares of the client population that are hostile, "
                     "comma-separated (each a run per attack; the worst case over the attacks per share)")
    rob.add_argument("--no-clean", action="store_true", help="attacks only (the clean runs measured in another --out)")
    _grid_arguments(rob)
    cmp_ = bench_sub.add_parser(
        "compare",
        help="every method + FedAvg-Prompt + the centralised references (incremental and joint) on identical splits",
    )
    cmp_.add_argument("--out", default="runs/bench-compare")
    cmp_.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    cmp_.add_argument(
        "--methods",
        default="",
        help="comma-separated (default: all); NAME/key=value/... is a variant with those "
        "NAME.* options, e.g. powder/dual=false (an ablation)",
    )
    cmp_.add_argument("--seeds", default="0,1,2")
    cmp_.add_argument(
        "--settings",
        default="dirichlet:0.5,dirichlet:0.1,quantity:1",
        help="heterogeneity levels: dirichlet:<beta>, quantity:<k> (k classes per client), "
        "quantity-skew:<beta> (client sizes from Dir(beta), labels IID), iid, or default "
        "(as configured)",
    )
    cmp_.add_argument(
        "--no-upper-bound",
        action="store_true",
        help="leave out the centralised references upper-bound-incremental and upper-bound-joint "
        "(they ignore the partition: one run per seed each)",
    )
    _grid_arguments(cmp_)
    show = sub.add_parser("show", help="print the result table of a finished run")
    show.add_argument("dir")
    sub.add_parser("strategies", help="list the available methods")
    aud = sub.add_parser(
        "audit",
        help="privacy audit: invert what the server received into images, score them "
        "against the clients' real images and against chance (audit.json, audit.png)",
    )
    aud.add_argument("--run", required=True, help="run directory with a checkpoint (--set keep-checkpoint=true)")
    aud.add_argument("--out", help="where audit.json and audit.png go (default: the run directory)")
    aud.add_argument("--steps", type=int, default=300, help="Adam steps per inversion")
    aud.add_argument("--lr", type=float, default=0.1)
    aud.add_argument("--tv-weight", type=float, default=0.01, help="weight of the total-variation prior")
    aud.add_argument("--distance", default="cosine", choices=("cosine", "l2"), help="feature distance")
    aud.add_argument("--seed", type=int, default=0)
    aud.add_argument("--max-real", type=int, default=256, help="real images per class scored against, at most")
    aud.add_argument("--classes", help="comma-separated classes (default: every class with a target)")
    aud.add_argument("--max-classes", type=int, default=0, help="at most this many classes (0: all)")
    args = parser.parse_args(argv)

    setup_logging()
    if args.command == "strategies":
        print("\n".join(sorted(methods())))
        return 0
    if args.command == "show":
        path = Path(args.dir) / "results.json"
        if not path.is_file():
            print(f"error: {path} does not exist", file=sys.stderr)
            return 2
        print(table(json.loads(path.read_text())))
        return 0

    if args.command == "pretrain":
        return _pretrain(args)
    if args.command == "audit":
        return _audit(args)
    if args.command == "bench":
        return _bench(args)
    try:
        if args.command == "resume":
            cfg = _resume_config(args.dir, args.set)
        else:
            cfg = load_config(args.config, args.set, args.strategy, args.out)
            _prepare_out_dir(cfg.output.out_dir, cfg.output.resume)
        check_weights(BackboneSpec.of(cfg.run, cfg.data, cfg.federation, cfg.model, cfg.caching))
        if cfg.evaluation.evaluation == "central":
            # the data loads here, before Ray starts, so a missing or broken dataset or a class count
            # that does not split into the tasks is reported at once; the ServerApp (this same
            # process) reuses what was loaded
            from ..common.data.cache import load_dataset_cached

            load_dataset_cached(cfg)
    except (ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    log.info("configuration: %s", json.dumps(cfg.to_dict(), sort_keys=True))
    interruptible_when_benchmarked()
    try:
        run_simulation(cfg, supernodes=args.supernodes, verbose=args.verbose)
    except ConfigError as exc:  # the cluster cannot host the clients as configured
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the whole chain: the project's message (file, fix) and the low-level cause
        print(f"error: simulation failed: {error_chain(exc)}", file=sys.stderr)
        return 1
    results = Path(cfg.output.out_dir) / "results.json"
    if not results.is_file():
        print(f"error: the run ended without writing {results}", file=sys.stderr)
        return 1
    return 0


def error_chain(exc: BaseException) -> str:
    """``Type: message`` of an exception and of everything that caused it, outermost first."""
    parts, seen = [], set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts.append(f"{type(current).__name__}: {current}")
        current = current.__cause__ or current.__context__
    return "\n  caused by ".join(parts)


#: run-config keys that say where a run computes, not what: `promptfcl resume` never reads them
#: from the checkpoint (``threads`` it keeps: a torch thread count can change a float reduction's
#: order, and so what the rest of the run computes)
PLACEMENT_KEYS = ("ray-address", "device", "client-cpus", "client-gpus")


def _resume_config(out_dir: str, overrides: list[str]) -> ExperimentConfig:
    saved = checkpoint.load(out_dir)
    if saved is None:
        raise ConfigError(f"{out_dir} holds no checkpoint to resume")
    raw = dict(saved.config)
    given = parse_overrides(overrides)
    # Where to run is this machine's choice, never the checkpoint's: a crafted checkpoint must
    # not join this driver to a foreign Ray cluster (whose traffic is pickled code).
    defaults = ExperimentConfig().to_dict()
    for key in PLACEMENT_KEYS:
        saved_value = raw.pop(key, defaults[key])
        now = given.get(key, defaults[key])
        if saved_value != now:
            log.info(
                "resume: %s = %r (the checkpoint had %r; where to run comes from the command line or the defaults)",
                key,
                now,
                saved_value,
            )
    raw.update(given)
    if "max-rounds" not in given and raw.get("max-rounds", 0) and saved.server_round >= int(raw["max-rounds"]):
        # the run stopped at its max-rounds: resuming it means going on (to the end, unless told)
        log.info("resume: max-rounds = %s was reached; going on to the end (--set max-rounds=N to stop earlier)",
                 raw["max-rounds"])
        raw["max-rounds"] = 0
    raw.update({"resume": True, "out-dir": out_dir})
    cfg = ExperimentConfig.from_dict(raw)
    check_run(cfg)
    checkpoint.check_compatible(saved, cfg.to_dict())
    return cfg


def _prepare_out_dir(out_dir: str, resume: bool) -> None:
    """Refuse to clobber an unfinished run in ``out_dir``; move a finished run's files aside, never
    delete them (nothing to do when the run ``resume``s)."""

    out = Path(out_dir)
    if resume:
        return
    if (out / checkpoint.FILENAME).exists() or (out / checkpoint.LEGACY_FILENAME).exists():
        raise ConfigError(
            f"{out} holds an unfinished run; continue it with `promptfcl resume {out}` or choose another --out"
        )
    if (out / "results.json").exists():
        stamp = _time.strftime("%Y%m%d-%H%M%S", _time.localtime((out / "results.json").stat().st_mtime))
        archive = out / "previous" / stamp
        archive.mkdir(parents=True, exist_ok=True)
        for item in out.iterdir():
            if item.name != "previous":
                shutil.move(str(item), archive / item.name)
        log.info("moved the previous results in %s to %s", out, archive)


def _grid_arguments(parser: argparse.ArgumentParser) -> None:
    """Where a grid benchmark's runs compute (server/bench/grid.py); none changes a run's results."""
    parser.add_argument("--parallel", type=int, default=1, metavar="N",
                        help="runs at once, each its own process with 1/N of the cores (client-cpus, threads) and "
                        "of the GPUs; with --ray-address: runs at once on the cluster (default there: one CPU each)")
    parser.add_argument("--ray-address", default="", metavar="ADDR",
                        help="submit the runs as Ray tasks to the running Ray cluster at ADDR (HOST:PORT or auto); "
                        "each run's files come back into --out")


def _shares(text: str) -> list[float]:
    """``--share``: comma-separated hostile shares, each in (0, 1)."""
    try:
        shares = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        shares = []
    if not shares or not all(0 < s < 1 for s in shares):
        raise ConfigError(f"--share must be comma-separated shares in (0, 1), got {text!r}")
    return shares


def _placement(args: argparse.Namespace) -> bench.Placement:
    if args.parallel < 1:
        raise ConfigError(f"--parallel must be >= 1, got {args.parallel}")
    return bench.Placement(args.parallel, args.ray_address)


def _bench(args: argparse.Namespace) -> int:
    try:
        return _bench_command(args)
    except KeyboardInterrupt:  # the grid stopped its runs and said what is done (server/bench/grid.py)
        return 130
    except bench.GridInterrupted:
        return 128 + signal.SIGTERM


def _bench_command(args: argparse.Namespace) -> int:
    try:
        if args.bench == "edge":
            wanted = [v for v in args.rows.split(",") if v]
            unknown = sorted(set(wanted) - {r[0] for r in ROWS} - {"none"})
            precisions = [v for v in args.precisions.split(",") if v]
            if unknown or args.batch_size < 1 or args.threads < 1 or set(precisions) - set(PRECISIONS):
                raise ConfigError(f"bench edge: unknown rows {unknown} (known: {', '.join(r[0] for r in ROWS)}), "
                                  f"--batch-size / --threads below 1, or precisions outside {PRECISIONS}")
            if wanted != ["none"]:
                bench.edge_rounds(Path(args.out), args.batch_size, args.threads,
                           [r for r in ROWS if not wanted or r[0] in wanted])
            seeds = [int(v) for v in args.accuracy_seeds.split(",") if v]
            if seeds:
                accuracy(Path(args.out), seeds, precisions)
            return 0
        if args.bench == "paper-dims":
            configs = sorted(Path(p) for p in glob.glob(args.configs))
            if not configs:
                raise ConfigError(f"no configuration matches {args.configs!r}")
            for path in configs:  # every file must load before the first (long) run starts
                load_config(str(path), [], None, None)
            bench.paper_dims(Path(args.out), configs)
            return 0
        if args.bench == "data-memory":
            sizes = tuple(int(v) for v in args.sizes.split(",") if v)
            if len(sizes) < 2 or min(sizes) < 200:
                raise ConfigError(f"--sizes needs at least two sizes of 200 images or more, got {args.sizes!r}")
            base = load_config(None, args.set, None, None).to_dict()
            bench.data_memory(Path(args.out), {k: v for k, v in base.items() if k not in ("out-dir", "strategy")},
                              sizes)
            return 0
        short = ["num-tasks=2", "rounds-per-task=3"] if args.bench == "deploy" else []  # a short run unless --set
        base = load_config(None, short + args.set, None, None).to_dict()
        base_cfg = ExperimentConfig.from_dict(base)
        check_weights(BackboneSpec.of(base_cfg.run, base_cfg.data, base_cfg.federation, base_cfg.model,
                                      base_cfg.caching))
        chosen = (
            [base["strategy"]]
            if args.bench == "deploy"
            else [m for m in args.methods.split(",") if m] or sorted(methods())
        )
        for m in chosen:  # every method (variant) must fit the configuration before any run starts
            name, options = bench.parse_method(m)
            check_run(ExperimentConfig.from_dict({**base, **options, "strategy": name}))
        base = {k: v for k, v in base.items() if k not in ("out-dir", "strategy")}
        if args.bench == "deploy":
            if args.nodes < 1:
                raise ConfigError(f"--nodes must be >= 1, got {args.nodes}")
            bench.deploy_overhead(Path(args.out), base, args.nodes)
        elif args.bench == "robustness":
            attacks = [a for a in args.attacks.split(",") if a]
            defences = [d for d in args.defences.split(",") if d]
            bad = [a for a in attacks if a not in FAULTS or not a] + [d for d in defences if d not in bench.DEFENCES]
            if bad:
                raise ConfigError(
                    f"unknown attacks or defences {bad}; attacks: {', '.join(f for f in FAULTS if f)}; "
                    f"defences: {', '.join(bench.DEFENCES)}"
                )
            bench.robustness(
                Path(args.out),
                base,
                chosen,
                attacks,
                defences,
                [int(v) for v in args.seeds.split(",")],
                _shares(args.share),
                clean=not args.no_clean,
                placement=_placement(args),
            )
        elif args.bench == "perf":
            pops = tuple(int(v) for v in args.populations.split(","))
            bench.perf(Path(args.out), base, populations=pops, methods=tuple(chosen))
        else:
            settings = [_parse_setting(s) for s in args.settings.split(",") if s]
            seeds = [int(v) for v in args.seeds.split(",")]
            upper_bound = not args.no_upper_bound and base.get("task-generator") != "random"  # no centralised form
            if base.get("task-generator") == "random" and settings != [{}]:  # the partition plays no part
                raise ConfigError("task-generator = random: partitions do not apply; use --settings default")
            bench.compare(Path(args.out), base, chosen, seeds, settings, upper_bound=upper_bound,
                          placement=_placement(args))
    except (ConfigError, DataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _parse_setting(text: str) -> dict[str, Any]:
    kind, _, value = text.partition(":")
    if kind == "default":  # the configuration as given (random tasks: no partition applies)
        return {}
    if kind == "dirichlet":
        return {"partition": "dirichlet", "dirichlet-beta": float(value or 0.5)}
    if kind == "quantity":
        return {"partition": "quantity", "classes-per-client": int(value or 1)}
    if kind == "quantity-skew":
        return {"partition": "quantity-skew", "dirichlet-beta": float(value or 0.5)}
    if kind == "iid":
        return {"partition": "iid"}
    raise ConfigError(
        f"unknown heterogeneity setting {text!r}: use dirichlet:<beta>, quantity:<k>, "
        "quantity-skew:<beta>, iid or default"
    )


def _audit(args: argparse.Namespace) -> int:
    try:
        classes = [int(c) for c in args.classes.split(",")] if args.classes else None
    except ValueError:
        print(f"error: --classes must be comma-separated integers, got {args.classes!r}", file=sys.stderr)
        return 2
    settings = AuditSettings(
        steps=args.steps,
        lr=args.lr,
        tv_weight=args.tv_weight,
        distance=args.distance,
        seed=args.seed,
        max_real=args.max_real,
    )
    try:
        audit_run(args.run, settings, classes=classes, max_classes=args.max_classes, out=args.out)
    except (ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _pretrain(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.set, None, None)
        path = checkpoint_path(BackboneSpec.of(cfg.run, cfg.data, cfg.federation, cfg.model, cfg.caching), args.source)
        if path.is_file() and not args.force:
            log.info("backbone pretrained on %s already cached at %s", args.source, path)
            return 0
        if args.epochs < 1:
            raise ConfigError("--epochs must be >= 1")
        pretrain(cfg, args.source, epochs=args.epochs)
    except (ConfigError, DataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
