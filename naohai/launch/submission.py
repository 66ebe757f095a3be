"""The `naohai submit` flow: check inputs, upload code (and data), create the job.

Owns the order of operations and what is printed; the job body and the HTTP form of
each call live in :mod:`naohai.launch.modelarts`, uploads in :mod:`naohai.launch.obs_upload`.
The recipe and strategy travel inside the uploaded code directory, so they must
live under it; the job refers to them by their relative paths.

A dry run (:func:`submit` with ``dry_run``, :func:`print_dry_run` for status, logs,
stop and list) prints the request that would be sent (method, URL, body; the
credentials masked) and makes no network call: no SDK client is built, nothing is
uploaded, no job is created or stopped.  Missing credentials or endpoint do not stop
a dry run; it names them as what the real request still needs.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, TextIO, Tuple

from naohai.config import load_recipe, resolve_recipe_path
from naohai.errors import UserError
from naohai.launch.credentials import (AK_VAR, PROJECT_VAR, SK_VAR, credentials_from_env, mask,
                                       modelarts_endpoint, obs_endpoint)
from naohai.strategy.run_plan import plan_run
from naohai.strategy.runtime import check_runnable
from naohai.launch.modelarts import (ApiRequest, JobPlatform, JobRequest, TrainingJobs, build_job_body,
                                     create_request, list_request, logs_request, path_param, show_request,
                                     stop_request)
from naohai.launch.obs_upload import (DEFAULT_EXCLUDES, MULTIPART_THRESHOLD, PART_SIZE, Uploader,
                                      collect_files, obs_client, parse_obs_path, plan_summary)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class SubmitOptions:
    """A job as the command line gives it: local paths (checked and uploaded here) and the platform."""

    recipe: str
    platform: JobPlatform
    code_obs: str
    output_obs: str
    strategy: Optional[str] = None
    overrides: List[str] = field(default_factory=list)
    log_obs: Optional[str] = None
    data: Optional[str] = None
    data_obs: Optional[str] = None
    endpoint: Optional[str] = None
    obs_endpoint: Optional[str] = None
    region: Optional[str] = None
    code_dir: str = REPO_ROOT
    excludes: tuple = DEFAULT_EXCLUDES
    multipart_threshold: int = MULTIPART_THRESHOLD
    part_size: int = PART_SIZE


def _inside(path: str, root: str, flag: str) -> str:
    """``path`` relative to ``root`` (posix form), or a UserError if it lies outside."""
    full = os.path.realpath(path)
    base = os.path.realpath(root)
    if os.path.commonpath([full, base]) != base:
        raise UserError(f"must be inside the uploaded code directory {base} (it travels with the code)",
                        where=path, key=flag)
    return os.path.relpath(full, base).replace(os.sep, "/")


def build_request(opts: SubmitOptions) -> JobRequest:
    """Check the recipe, strategy and OBS paths locally; return the job request."""
    recipe_path = resolve_recipe_path(opts.recipe)
    recipe = load_recipe(recipe_path, opts.overrides)   # fail here, not after an upload and a queue
    strategy_rel = None
    device = opts.platform.device
    if device not in ("Ascend", "GPU", "CPU", "auto"):
        raise UserError(f"'{device}' is not one of Ascend, GPU, CPU, auto", where="command line",
                        key="--device")
    if opts.strategy:
        run = plan_run(recipe, opts.strategy)   # the checks every worker will make
        run.tell()
        if device != "auto":
            check_runnable(run.strategy, device, opts.recipe)
        strategy_rel = _inside(opts.strategy, opts.code_dir, "--strategy")
    if opts.data and not opts.data_obs:
        raise UserError("--data needs --data-obs /bucket/path/ to upload it to", where="command line",
                        key="--data-obs")
    if opts.data and not os.path.exists(opts.data):
        raise UserError("does not exist", where=opts.data, key="--data")
    return JobRequest(
        platform=opts.platform, recipe=_inside(recipe_path, opts.code_dir, "recipe"), strategy=strategy_rel,
        overrides=list(opts.overrides),
        code_obs=parse_obs_path(opts.code_obs, "--code-obs"),
        output_obs=parse_obs_path(opts.output_obs, "--output-obs"),
        log_obs=parse_obs_path(opts.log_obs, "--log-obs") if opts.log_obs else None,
        data_obs=parse_obs_path(opts.data_obs, "--data-obs") if opts.data_obs else None)


def describe_credentials(environ: Mapping[str, str]) -> str:
    ak = environ.get(AK_VAR, "")
    return (f"credentials: {AK_VAR}={mask(ak) or '(unset)'} {SK_VAR}="
            f"{'<redacted>' if environ.get(SK_VAR) else '(unset)'} {PROJECT_VAR}="
            f"{environ.get(PROJECT_VAR) or '(unset)'}")


def submit(opts: SubmitOptions, environ: Mapping[str, str], dry_run: bool = False,
           out: Optional[TextIO] = None) -> Optional[str]:
    """Upload and create the job; returns its id (None for a dry run)."""
    out = out or sys.stdout
    req = build_request(opts)
    body = build_job_body(req)
    files = collect_files(opts.code_dir, opts.excludes)
    count, size = plan_summary(files)
    print(f"code: {opts.code_dir} -> obs:/{req.code_obs.api_form} ({count} files, {size} bytes)", file=out)
    if opts.data:
        print(f"data: {opts.data} -> obs:/{req.data_obs.api_form}", file=out)
    if dry_run:
        endpoint, project_id, needs = dry_run_target(environ, opts.endpoint, opts.region)
        print("files that would be uploaded:", file=out)
        for path, rel in files:
            print(f"  {rel} ({os.path.getsize(path)} bytes)", file=out)
        print(describe_credentials(environ), file=out)
        print("job request (dry run, nothing uploaded or created):", file=out)
        print(_named(create_request(project_id, body), project_id).render(endpoint, indent=2), file=out)
        _print_needs(needs, out)
        return None
    creds = credentials_from_env(environ)
    jobs = TrainingJobs(creds, modelarts_endpoint(opts.endpoint, opts.region))
    uploader = Uploader(obs_client(creds, obs_endpoint(opts.obs_endpoint, opts.region)), creds,
                        threshold=opts.multipart_threshold, part_size=opts.part_size)
    n, b = uploader.upload_tree(opts.code_dir, req.code_obs, opts.excludes)
    print(f"uploaded code: {n} files, {b} bytes", file=out)
    if opts.data:
        n, b = uploader.upload_path(opts.data, req.data_obs, opts.excludes)
        print(f"uploaded data: {n} files, {b} bytes", file=out)
    created = jobs.create(body)
    meta = created.get("metadata") or {}
    job_id = meta.get("id")
    phase = (created.get("status") or {}).get("phase", "?")
    print(f"created job {meta.get('name', opts.platform.name)}: id {job_id}, phase {phase}", file=out)
    return job_id


#: what a dry run's URL shows for an endpoint or project id not given
ENDPOINT_PLACEHOLDER, PROJECT_PLACEHOLDER = "{endpoint}", "{project_id}"


def dry_run_target(environ: Mapping[str, str], endpoint: Optional[str],
                   region: Optional[str]) -> Tuple[str, str, List[str]]:
    """The endpoint and project id a dry run's request names, and what the real request still needs.

    Reads flags and the environment only: no SDK, no network.  A malformed ``--endpoint`` is a
    UserError here as in a real run; a missing one (or a missing variable) becomes a placeholder
    and an entry of the returned list."""
    needs = []
    if endpoint or region:
        url = modelarts_endpoint(endpoint, region)
    else:
        url = ENDPOINT_PLACEHOLDER
        needs.append("give --endpoint URL or --region")
    for var in (AK_VAR, SK_VAR, PROJECT_VAR):
        if not (environ.get(var) or "").strip():
            needs.append(f"export {var}")
    project_id = (environ.get(PROJECT_VAR) or "").strip() or PROJECT_PLACEHOLDER
    return url, project_id, needs


def _named(req: ApiRequest, project_id: str) -> ApiRequest:
    """``req`` with the project placeholder shown as written, not percent-quoted."""
    if project_id != PROJECT_PLACEHOLDER:
        return req
    path = req.path.replace(path_param(PROJECT_PLACEHOLDER), PROJECT_PLACEHOLDER, 1)
    return ApiRequest(req.method, path, req.body)


def _print_needs(needs: List[str], out: TextIO) -> None:
    if needs:
        print(f"the real request cannot be sent as is: {'; '.join(needs)}", file=out)


def action_request(action: str, project_id: str, job_id: Optional[str] = None, task_id: str = "worker-0",
                   limit: int = 20) -> ApiRequest:
    """The request of `naohai submit status|logs|stop|list`, as :class:`TrainingJobs` sends it."""
    if action == "list":
        return list_request(project_id, limit)
    if action == "status":
        return show_request(project_id, job_id)
    if action == "logs":
        return logs_request(project_id, job_id, task_id)
    if action == "stop":
        return stop_request(project_id, job_id)
    raise ValueError(f"unknown action {action!r}")


def print_dry_run(action: str, environ: Mapping[str, str], endpoint: Optional[str], region: Optional[str],
                  job_id: Optional[str] = None, task_id: str = "worker-0", limit: int = 20,
                  out: Optional[TextIO] = None) -> ApiRequest:
    """Print the request `naohai submit ACTION` would send, and send nothing; returns it."""
    out = out or sys.stdout
    url, project_id, needs = dry_run_target(environ, endpoint, region)
    req = _named(action_request(action, project_id, job_id, task_id, limit), project_id)
    effect = f"; job {job_id} is not stopped" if action == "stop" else ""
    print(f"request of `naohai submit {action}` (dry run, nothing sent{effect}):", file=out)
    print(req.render(url), file=out)
    print(describe_credentials(environ), file=out)
    _print_needs(needs, out)
    return req


def jobs_client(environ: Mapping[str, str], endpoint: Optional[str], region: Optional[str]) -> TrainingJobs:
    return TrainingJobs(credentials_from_env(environ), modelarts_endpoint(endpoint, region))


def format_status(job: dict) -> str:
    meta, status = job.get("metadata") or {}, job.get("status") or {}
    spec = ((job.get("spec") or {}).get("resource") or {})
    lines = [f"job {meta.get('id')} ({meta.get('name')})",
             f"  phase: {status.get('phase')} / {status.get('secondary_phase')}",
             f"  duration: {int(status.get('duration') or 0) // 1000} s"]
    if spec:
        lines.append(f"  resource: {spec.get('flavor_id')} x {spec.get('node_count')}")
    if status.get("tasks"):
        lines.append(f"  tasks: {', '.join(status['tasks'])}")
    return "\n".join(lines)


def format_list(listing: dict) -> str:
    rows = [("ID", "NAME", "PHASE")]
    for item in listing.get("items") or []:
        meta, status = item.get("metadata") or {}, item.get("status") or {}
        rows.append((str(meta.get("id")), str(meta.get("name")), str(status.get("phase"))))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
