"""`naohai submit`: create a ModelArts training job, or inspect one.

    naohai submit RECIPE [key=value ...] --name N --flavor F ...   create (uploads code first)
    naohai submit status JOB_ID | logs JOB_ID [--task T] | stop JOB_ID | list [--limit N]
"""
from __future__ import annotations

import os

from naohai.commands._args import allow_intermixed
from naohai.errors import UserError

ACTIONS = {"status": 1, "logs": 1, "stop": 1, "list": 0}


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
                   help="recipe to submit, or an action on existing jobs")
    p.add_argument("rest", nargs="*", metavar="key=value|JOB_ID",
                   help="recipe overrides, or the job id for status/logs/stop")
    p.add_argument("--strategy", help="strategy file (inside the code directory)")
    p.add_argument("--device", choices=("Ascend", "GPU", "CPU", "auto"), default="Ascend",
                   help="device the workers train on (default Ascend; passed to the boot script)")
    p.add_argument("--name", help="job name (letters, digits, '-', '_')")
    p.add_argument("--flavor", help="resource flavor id, e.g. modelarts.pool.visual.xlarge")
    p.add_argument("--nodes", type=int, default=1, help="node count (default 1)")
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
    p.add_argument("--task", default="worker-0", help="task whose log `logs` shows (default worker-0)")
    p.add_argument("--limit", type=int, default=20, help="jobs shown by `list` (default 20)")
    p.add_argument("--dry-run", action="store_true", help="print what would be uploaded and the job body")
    p.set_defaults(run=run)
    allow_intermixed(p)


def run(args) -> int:
    from naohai.launch import submission   # MindSpore (the strategy checks): imported when a job is made
    from naohai.launch.modelarts import JobPlatform

    if args.target in ACTIONS and not os.path.isfile(args.target):
        return _action(args)
    missing = [flag for flag, value in (("--name", args.name), ("--flavor", args.flavor),
                                        ("--code-obs", args.code_obs), ("--output-obs", args.output_obs))
               if not value]
    if missing:
        raise UserError(f"creating a job needs {', '.join(missing)}", where="command line", key=missing[0])
    platform = JobPlatform(name=args.name, flavor=args.flavor, nodes=args.nodes, image_url=args.image_url,
                           engine_name=args.engine_name, engine_version=args.engine_version,
                           pool_id=args.pool_id, workspace_id=args.workspace_id, device=args.device)
    opts = submission.SubmitOptions(
        recipe=args.target, platform=platform, overrides=list(args.rest), strategy=args.strategy,
        code_obs=args.code_obs, output_obs=args.output_obs, log_obs=args.log_obs, data=args.data,
        data_obs=args.data_obs, endpoint=args.endpoint, obs_endpoint=args.obs_endpoint, region=args.region,
        code_dir=args.code_dir or submission.REPO_ROOT)
    submission.submit(opts, os.environ, dry_run=args.dry_run)
    return 0


def _action(args) -> int:
    from naohai.launch import submission

    want = ACTIONS[args.target]
    if len(args.rest) != want:
        usage = f"naohai submit {args.target}" + (" JOB_ID" if want else "")
        raise UserError(f"usage: {usage}", where="command line")
    jobs = submission.jobs_client(os.environ, args.endpoint, args.region)
    if args.target == "list":
        print(submission.format_list(jobs.list(limit=args.limit)))
    elif args.target == "status":
        print(submission.format_status(jobs.show(args.rest[0])))
    elif args.target == "logs":
        print(jobs.logs(args.rest[0], args.task), end="")
    else:
        done = jobs.stop(args.rest[0])
        print(f"stop requested for job {args.rest[0]}: phase {(done.get('status') or {}).get('phase')}")
    return 0
