"""`naohai submit`: create a ModelArts training job, or inspect one.

    naohai submit RECIPE [key=value ...] --name N --flavor F ...   create (uploads code first)
    naohai submit status JOB_ID | logs JOB_ID [--task T] | stop JOB_ID | list [--limit N]

``--dry-run`` works with every action: it prints the request that would be sent
(method, URL, body; credentials masked) and sends nothing, so ``stop --dry-run``
stops no job.  A flag the chosen action would not read (``--task`` without ``logs``,
``--limit`` without ``list``, the job flags such as ``--name`` without a RECIPE)
exits 2 naming it; ``--limit`` is 1 to 50 (the platform's page size).
"""
from __future__ import annotations

import os

from naohai.commands._args import allow_intermixed
from naohai.errors import UserError

ACTIONS = {"status": 1, "logs": 1, "stop": 1, "list": 0}
#: flags read only when creating a job (dest, flag); their defaults are None so that "given" is known
CREATE_FLAGS = (("strategy", "--strategy"), ("device", "--device"), ("name", "--name"), ("flavor", "--flavor"),
                ("nodes", "--nodes"), ("image_url", "--image-url"), ("engine_name", "--engine-name"),
                ("engine_version", "--engine-version"), ("code_obs", "--code-obs"), ("code_dir", "--code-dir"),
                ("output_obs", "--output-obs"), ("log_obs", "--log-obs"), ("data", "--data"),
                ("data_obs", "--data-obs"), ("pool_id", "--pool-id"), ("workspace_id", "--workspace-id"),
                ("obs_endpoint", "--obs-endpoint"))
#: flags read by one action only: dest -> (flag, action, what it is)
ACTION_FLAGS = {"task": ("--task", "logs", "the task whose log `naohai submit logs JOB_ID` shows"),
                "limit": ("--limit", "list", "the number of jobs `naohai submit list` shows")}
DEFAULT_DEVICE, DEFAULT_NODES, DEFAULT_TASK, DEFAULT_LIMIT = "Ascend", 1, "worker-0", 20


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "submit", help="submit a training job to ModelArts (or: submit status|logs|stop JOB_ID, submit list)",
        description="Create a ModelArts training job running run/modelarts_boot.sh on every node: "
                    "naohai submit RECIPE [key=value ...] --name N --flavor F --code-obs /bucket/code/ "
                    "--output-obs /bucket/out/ (--image-url U | --engine-name E --engine-version V). "
                    "Inspect jobs with: naohai submit status JOB_ID | logs JOB_ID | stop JOB_ID | list. "
                    "Credentials come from HUAWEICLOUD_SDK_AK, HUAWEICLOUD_SDK_SK, "
                    "HUAWEICLOUD_SDK_PROJECT_ID.")
    p.add_argument("target", metavar="RECIPE|status|logs|stop|list",
                   help="recipe to submit, or an action on existing jobs (a recipe file named like an action "
                        "is given as ./NAME)")
    p.add_argument("rest", nargs="*", metavar="key=value|JOB_ID",
                   help="recipe overrides, or the job id for status/logs/stop")
    p.add_argument("--strategy", help="strategy file (inside the code directory)")
    p.add_argument("--device", choices=("Ascend", "GPU", "CPU", "auto"), default=None,
                   help="device the workers train on (default Ascend; passed to the boot script)")
    p.add_argument("--name", help="job name (letters, digits, '-', '_')")
    p.add_argument("--flavor", help="resource flavor id, e.g. modelarts.pool.visual.xlarge")
    p.add_argument("--nodes", type=int, default=None, help="node count (default 1)")
    p.add_argument("--image-url", help="custom image (SWR path)")
    p.add_argument("--engine-name", help="preset engine name, e.g. MindSpore")
    p.add_argument("--engine-version", help="preset engine version")
    p.add_argument("--code-obs", help="OBS folder for the code, /bucket/path/")
    p.add_argument("--code-dir",
                   help="local code directory to upload (default: this naohai checkout)")
    p.add_argument("--output-obs", help="OBS folder for outputs (train.output_dir), /bucket/path/")
    p.add_argument("--log-obs", help="OBS folder for the platform's job logs")
    p.add_argument("--data", help="local data (prepared shards) to upload to --data-obs")
    p.add_argument("--data-obs", help="OBS folder of the data (becomes data.prepared_dir on the nodes)")
    p.add_argument("--pool-id", help="dedicated resource pool id")
    p.add_argument("--workspace-id", help="ModelArts workspace id")
    p.add_argument("--endpoint", help="ModelArts endpoint URL (default from --region)")
    p.add_argument("--obs-endpoint", help="OBS endpoint URL (default from --region)")
    p.add_argument("--region", help="region, e.g. cn-southwest-2")
    p.add_argument("--task", default=None, help="task whose log `logs` shows (default worker-0; `logs` only)")
    p.add_argument("--limit", type=int, default=None,
                   help="jobs shown by `list`, 1 to 50 (default 20; `list` only)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the request that would be sent (method, URL, body; for a new job also the files "
                        "that would be uploaded) and send nothing; with every action, stop included")
    p.set_defaults(run=run)
    allow_intermixed(p)


def run(args) -> int:
    action = args.target if args.target in ACTIONS else None      # a recipe file named so: ./stop
    _refuse_unread_flags(args, action)       # before any credential, SDK or network
    if action:
        return _action(args, action)

    from naohai.launch import submission   # MindSpore (the strategy checks): imported when a job is made
    from naohai.launch.modelarts import JobPlatform

    missing = [flag for flag, value in (("--name", args.name), ("--flavor", args.flavor),
                                        ("--code-obs", args.code_obs), ("--output-obs", args.output_obs))
               if not value]
    if missing:
        raise UserError(f"creating a job needs {', '.join(missing)}", where="command line", key=missing[0])
    platform = JobPlatform(name=args.name, flavor=args.flavor,
                           nodes=DEFAULT_NODES if args.nodes is None else args.nodes, image_url=args.image_url,
                           engine_name=args.engine_name, engine_version=args.engine_version,
                           pool_id=args.pool_id, workspace_id=args.workspace_id,
                           device=args.device or DEFAULT_DEVICE)
    opts = submission.SubmitOptions(
        recipe=args.target, platform=platform, overrides=list(args.rest), strategy=args.strategy,
        code_obs=args.code_obs, output_obs=args.output_obs, log_obs=args.log_obs, data=args.data,
        data_obs=args.data_obs, endpoint=args.endpoint, obs_endpoint=args.obs_endpoint, region=args.region,
        code_dir=args.code_dir or submission.REPO_ROOT)
    submission.submit(opts, os.environ, dry_run=args.dry_run)
    return 0


def _refuse_unread_flags(args, action) -> None:
    """A flag the chosen action would not read is a UserError naming it (it would be silently ignored)."""
    from naohai.launch.modelarts import LIST_LIMIT_MAX, LIST_LIMIT_MIN

    doing = f"`naohai submit {action}`" if action else "creating a job (`naohai submit RECIPE`)"
    for dest, (flag, owner, what) in ACTION_FLAGS.items():
        if getattr(args, dest) is not None and action != owner:
            raise UserError(f"{flag} is {what}; {doing} does not read it, so it would be ignored. Drop {flag}, "
                            f"or run `naohai submit {owner}`", where="command line", key=flag,
                            rule=f"{flag} only with `naohai submit {owner}`")
    if action:
        for dest, flag in CREATE_FLAGS:
            if getattr(args, dest) is not None:
                raise UserError(f"{flag} describes a job to create; {doing} does not read it, so it would be "
                                f"ignored. Drop {flag} (or give a RECIPE to create a job)",
                                where="command line", key=flag, rule=f"{flag} only when creating a job")
    if args.limit is not None and not LIST_LIMIT_MIN <= args.limit <= LIST_LIMIT_MAX:
        raise UserError(f"must be {LIST_LIMIT_MIN} to {LIST_LIMIT_MAX} jobs (the platform's page size), got "
                        f"{args.limit}", where="command line", key="--limit",
                        rule=f"{LIST_LIMIT_MIN} <= --limit <= {LIST_LIMIT_MAX}")
    if args.task is not None and not args.task.strip():
        raise UserError("is empty; give a task id such as worker-0 (`naohai submit status JOB_ID` lists them)",
                        where="command line", key="--task", rule="--task TASK_ID, not empty")


def _action(args, action: str) -> int:
    from naohai.launch import submission

    want = ACTIONS[action]
    if len(args.rest) != want:
        usage = f"naohai submit {action}" + (" JOB_ID" if want else "")
        got = " ".join(args.rest) or "nothing"
        raise UserError(f"`naohai submit {action}` takes {'one JOB_ID' if want else 'no other words'}, got "
                        f"{got}", where="command line", rule=f"usage: {usage}")
    job_id = args.rest[0] if want else None
    if want and not job_id.strip():
        raise UserError("the JOB_ID is empty; `naohai submit list` shows the ids", where="command line",
                        rule=f"usage: naohai submit {action} JOB_ID")
    task = DEFAULT_TASK if args.task is None else args.task
    limit = DEFAULT_LIMIT if args.limit is None else args.limit
    if args.dry_run:     # flags and the environment only: no SDK client, no credential call, no network
        submission.print_dry_run(action, os.environ, args.endpoint, args.region, job_id=job_id, task_id=task,
                                 limit=limit)
        return 0
    jobs = submission.jobs_client(os.environ, args.endpoint, args.region)
    if action == "list":
        print(submission.format_list(jobs.list(limit=limit)))
    elif action == "status":
        print(submission.format_status(jobs.show(job_id)))
    elif action == "logs":
        print(jobs.logs(job_id, task), end="")
    else:
        done = jobs.stop(job_id)
        print(f"stop requested for job {job_id}: phase {(done.get('status') or {}).get('phase')}")
    return 0
