"""`naohai launch`: start `naohai train` on this node through msrun."""
from __future__ import annotations

import argparse
import dataclasses

from naohai.commands._args import allow_intermixed
from naohai.errors import UserError
from naohai.launch.msrun import DEFAULT_PORT, MsrunPlan, run_msrun, scheduler_port, validate_plan


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "launch", help="run `naohai train` on this node with msrun (one command per node)",
        description="Build and run this node's msrun command for `python -m naohai.cli train RECIPE "
                    "--strategy FILE`. The worker count is the product of the strategy's mesh "
                    "sizes, else --devices-per-node x --nodes. Run the same command on every node "
                    "with its own --node-rank.")
    p.add_argument("recipe", help="recipe file (or a name in recipes/)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides passed to train")
    p.add_argument("--strategy", help="strategy file passed to train")
    p.add_argument("--device", choices=("auto", "CPU", "GPU", "Ascend"),
                   help="device for every worker (default: the recipe's train.device; auto = Ascend, else GPU, "
                        "else CPU, decided here and passed to the workers)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index, 0-based (default 0)")
    p.add_argument("--master-addr", help="IP or host name of node 0 (required for several nodes)")
    p.add_argument("--master-port", help="node 0's scheduler port (default: on one node a free port, not "
                                          f"{DEFAULT_PORT} where MindSpore's workers listen; on several, "
                                          f"{DEFAULT_PORT}, msrun's default); a port in use is refused")
    p.add_argument("--devices-per-node", type=int, help="worker processes per node")
    p.add_argument("--log-dir", help="folder of MindSpore's logs: msrun.log and worker_<rank>.log "
                                     "(default <train.output_dir>/msrun_logs)")
    p.add_argument("--verbose", action="store_true",
                   help="show msrun's whole output (MindSpore's logs) here, not only naohai's lines per rank")
    p.add_argument("--oversubscribe", action="store_true",
                   help="start CPU workers even beyond 2 per core or the machine's available memory")
    p.add_argument("--join", action=argparse.BooleanOptionalAction, default=True,
                   help="wait for the workers and report failures (default; --no-join returns at once)")
    p.add_argument("--cluster-time-out", type=int, default=600,
                   help="seconds to wait for the cluster to form (default 600)")
    p.add_argument("--node-time-out", type=int,
                   help="seconds before a silent rank is declared dead (MS_NODE_TIMEOUT; MindSpore default 30). "
                        "On CPU it also bounds each collective's wait, so the host barriers (after compiling, "
                        "at checkpoints) fail when one rank arrives that much before another")
    p.add_argument("--bind-core", action="store_true", help="let msrun bind CPU cores to workers")
    p.add_argument("--rank-table", help="rank table file (passed to msrun; see --rank-table-processes)")
    p.add_argument("--rank-table-processes", action="store_true",
                   help="legacy start without msrun: one process per device with RANK_TABLE_FILE, "
                        "RANK_ID, DEVICE_ID")
    p.add_argument("--dry-run", action="store_true", help="print the command only")
    p.set_defaults(run=run)
    allow_intermixed(p)


def run(args) -> int:
    import contextlib

    from naohai.devices import runs_on_cpu
    from naohai.launch.devices import worker_count
    from naohai.runfiles import holding_folder
    from naohai.strategy.host_memory import check_host_memory
    from naohai.strategy.run_plan import plan_run

    workers = worker_count(args.strategy, args.devices_per_node, args.nodes)
    # every recipe and strategy rule first (no MindSpore yet): a mistake is told as itself, busy folder or not
    planned = plan_run(args.recipe, args.strategy, list(args.overrides))
    if not args.dry_run:
        # this node's CPU workers share its memory: a run too big for it is told before the folder is taken
        check_host_memory(planned, processes=max(1, workers // max(1, args.nodes)),
                          on_cpu=lambda: runs_on_cpu(args.device or planned.recipe.train.device))
    output_dir = planned.recipe.train.output_dir
    # the run folder belongs to this launch for its whole life: a second launch (or train) on it exits 2
    # naming this process; the workers msrun starts are its descendants and share the lock
    ours = not args.dry_run and args.node_rank == 0
    with holding_folder(output_dir, "training run", key="train.output_dir") if ours else contextlib.nullcontext():
        return _launch(args, workers, planned)


def _launch(args, workers: int, planned) -> int:
    import os

    from naohai.launch.devices import check_machine
    from naohai.launch.preflight import preflight   # MindSpore: imported once the folder is ours, not for --help
    output_dir = planned.recipe.train.output_dir
    # the device, and a layout it cannot run refused, before any worker starts
    device = preflight(planned, " ".join([args.recipe, *args.overrides]), args.device, args.dry_run)
    log_dir = args.log_dir or os.path.join(output_dir, "msrun_logs")
    if not args.dry_run:
        check_machine(workers // max(1, args.nodes), device, args.oversubscribe, print)
    plan = MsrunPlan(recipe=args.recipe, strategy=args.strategy, workers=workers, nodes=args.nodes,
                     node_rank=args.node_rank, master_addr=args.master_addr,
                     master_port=DEFAULT_PORT if args.master_port is None else args.master_port,
                     log_dir=log_dir, join=args.join, cluster_time_out=args.cluster_time_out,
                     bind_core=args.bind_core, node_time_out=args.node_time_out, rank_table_file=args.rank_table,
                     rank_table_mode="processes" if args.rank_table_processes else "msrun",
                     overrides=list(args.overrides), device=device)
    if args.rank_table is not None and not args.dry_run and not os.path.isfile(args.rank_table):
        raise UserError("is not a file (the rank table msrun reads on this node; a dry run prints the command "
                        "for another node without it)", where=args.rank_table, key="--rank-table",
                        rule="an existing rank table file")
    if plan.node_rank == 0 and not args.rank_table_processes:
        # node 0's scheduler: a free port on one node unless one is given; a given one checked (a dry run
        # checks nothing, but shows the kind of port a run takes)
        checked = validate_plan(plan)
        given = None if args.master_port is None else checked.master_port
        if not args.dry_run or (given is None and checked.nodes == 1):
            plan = dataclasses.replace(plan, master_port=scheduler_port(checked.master_addr, given,
                                                                        nodes=checked.nodes))
    return run_msrun(plan, dry_run=args.dry_run, verbose=args.verbose)
