"""ModelArts training jobs: the v2 job body and the calls that create, show, list,
stop and read logs of jobs through the official SDK (``huaweicloudsdkmodelarts``).

Each call is also described as the HTTP request the SDK sends for it (:class:`ApiRequest`:
method, path under the endpoint, JSON body; the SDK adds the signature headers), built
without the SDK or the network: ``naohai submit ... --dry-run`` prints these and sends
nothing.  The bodies :class:`TrainingJobs` sends come from the same functions.

The job runs ``run/modelarts_boot.sh`` from the uploaded code directory once per
node.  ModelArts hands the boot file its parameters and the local paths of the
inputs/outputs as ``--name=value`` arguments: ``--recipe``, ``--strategy``,
``--overrides`` (space separated), ``--data`` (local copy of ``data_obs``, used as
``data.prepared_dir``) and ``--output`` (synced to ``output_obs``, used as
``train.output_dir``).

Platform errors (4xx/5xx) become UserErrors with the platform's error_code,
error_msg and request_id; a refused connection says which endpoint refused.  The
secret key never appears in a message.
"""
from __future__ import annotations

import json
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from naohai.errors import UserError
from naohai.launch.credentials import Credentials, require
from naohai.launch.obs_upload import ObsPath

BOOT_FILE = "run/modelarts_boot.sh"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


@dataclass
class JobPlatform:
    """What a job runs as and on: its name, the resources, the image or preset engine, the device."""

    name: str
    flavor: str
    nodes: int = 1
    image_url: Optional[str] = None
    engine_name: Optional[str] = None
    engine_version: Optional[str] = None
    pool_id: Optional[str] = None
    workspace_id: Optional[str] = None
    device: str = "Ascend"           # passed to the boot script, then to every worker


@dataclass
class JobRequest:
    """Everything `naohai submit` needs to describe one training job."""

    platform: JobPlatform
    recipe: str                      # path relative to the code directory
    strategy: Optional[str]          # path relative to the code directory
    code_obs: ObsPath
    output_obs: ObsPath
    overrides: List[str] = field(default_factory=list)
    log_obs: Optional[ObsPath] = None
    data_obs: Optional[ObsPath] = None
    description: str = "naohai training job"
    environments: Dict[str, str] = field(default_factory=dict)


def validate_platform(req: JobPlatform) -> None:
    if not _NAME_RE.match(req.name or ""):
        raise UserError(f"job name '{req.name}' must be 1-64 letters, digits, '-' or '_', starting with a "
                        "letter or digit", where="command line", key="--name")
    if isinstance(req.nodes, bool) or not isinstance(req.nodes, int) or req.nodes < 1:
        raise UserError(f"must be a positive integer, got {req.nodes!r}", where="command line", key="--nodes")
    if not req.flavor:
        raise UserError("a resource flavor is required (e.g. modelarts.pool.visual.xlarge)",
                        where="command line", key="--flavor")
    has_engine = bool(req.engine_name or req.engine_version)
    if bool(req.image_url) == has_engine:
        raise UserError("give either --image-url or --engine-name with --engine-version (exactly one)",
                        where="command line", key="--image-url")
    if has_engine and not (req.engine_name and req.engine_version):
        raise UserError("--engine-name and --engine-version go together", where="command line",
                        key="--engine-version")


def _obs_io(name: str, path: ObsPath) -> Dict[str, Any]:
    return {"name": name, "remote": {"obs": {"obs_url": path.api_form}}}


def build_job_body(req: JobRequest) -> Dict[str, Any]:
    """The JSON body of POST /v2/{project_id}/training-jobs."""
    job = req.platform
    validate_platform(job)
    params = [{"name": "recipe", "value": req.recipe}]
    if req.strategy:
        params.append({"name": "strategy", "value": req.strategy})
    if req.overrides:
        params.append({"name": "overrides", "value": " ".join(req.overrides)})
    params.append({"name": "device", "value": job.device})
    algorithm: Dict[str, Any] = {
        "code_dir": req.code_obs.api_form,
        "boot_file": req.code_obs.child(BOOT_FILE).api_form,
        "parameters": params,
        "inputs": [_obs_io("data", req.data_obs)] if req.data_obs else [],
        "outputs": [_obs_io("output", req.output_obs)],
        "environments": dict({"PYTHONUNBUFFERED": "1"}, **req.environments),
    }
    if job.image_url:
        algorithm["engine"] = {"image_url": job.image_url}
    else:
        algorithm["engine"] = {"engine_name": job.engine_name, "engine_version": job.engine_version}
    metadata: Dict[str, Any] = {"name": job.name, "description": req.description}
    if job.workspace_id:
        metadata["workspace_id"] = job.workspace_id
    resource: Dict[str, Any] = {"flavor_id": job.flavor, "node_count": job.nodes}
    if job.pool_id:
        resource["pool_id"] = job.pool_id
    spec: Dict[str, Any] = {"resource": resource}
    if req.log_obs:
        spec["log_export_path"] = {"obs_url": req.log_obs.api_form}
    return {"kind": "job", "metadata": metadata, "algorithm": algorithm, "spec": spec}


# ---------------------------------------------------------------------- requests as HTTP
#: the page sizes the platform accepts (``limit`` of POST .../training-job-searches: 1 to 50)
LIST_LIMIT_MIN, LIST_LIMIT_MAX = 1, 50
STOP_BODY = {"action_type": "terminate"}


def list_body(limit: int = 20, offset: int = 0) -> Dict[str, Any]:
    """The JSON body of POST /v2/{project_id}/training-job-searches."""
    return {"limit": limit, "offset": offset, "sort_by": "create_time", "order": "desc"}


@dataclass(frozen=True)
class ApiRequest:
    """One ModelArts call as HTTP: what ``--dry-run`` prints (the SDK sends it signed)."""

    method: str
    path: str                                  # from /v2/, path parameters quoted as the SDK quotes them
    body: Optional[Dict[str, Any]] = None

    def url(self, endpoint: str) -> str:
        return endpoint.rstrip("/") + self.path

    def render(self, endpoint: str, indent: Optional[int] = None) -> str:
        """``METHOD URL`` and, on the next line, the JSON body (if any)."""
        text = f"{self.method} {self.url(endpoint)}"
        if self.body is not None:
            text += "\n" + json.dumps(self.body, indent=indent, ensure_ascii=False)
        return text


def path_param(value: str) -> str:
    """A path parameter as the SDK puts it in the path (``quote(str(v), safe='')``)."""
    return urllib.parse.quote(str(value), safe="")


def _jobs(project_id: str) -> str:
    return f"/v2/{path_param(project_id)}/training-jobs"


def create_request(project_id: str, body: Dict[str, Any]) -> ApiRequest:
    return ApiRequest("POST", _jobs(project_id), body)


def show_request(project_id: str, job_id: str) -> ApiRequest:
    return ApiRequest("GET", f"{_jobs(project_id)}/{path_param(job_id)}")


def list_request(project_id: str, limit: int = 20, offset: int = 0) -> ApiRequest:
    return ApiRequest("POST", f"/v2/{path_param(project_id)}/training-job-searches", list_body(limit, offset))


def stop_request(project_id: str, job_id: str) -> ApiRequest:
    return ApiRequest("POST", f"{_jobs(project_id)}/{path_param(job_id)}/actions", dict(STOP_BODY))


def logs_request(project_id: str, job_id: str, task_id: str = "worker-0") -> ApiRequest:
    return ApiRequest("GET", f"{_jobs(project_id)}/{path_param(job_id)}/tasks/{path_param(task_id)}/logs/preview")


class TrainingJobs:
    """The five job calls, with platform errors turned into UserErrors."""

    def __init__(self, creds: Credentials, endpoint: str, timeout: float = 30.0, retries: int = 0):
        self.creds = creds
        self.endpoint = endpoint
        core_auth = require("huaweicloudsdkcore.auth.credentials")
        core_http = require("huaweicloudsdkcore.http.http_config")
        self._m = require("huaweicloudsdkmodelarts.v1")
        cfg = core_http.HttpConfig.get_default_config()
        cfg.timeout = (min(10.0, timeout), timeout)
        cfg.retry_times = retries
        cfg.ignore_ssl_verification = False
        basic = core_auth.BasicCredentials(creds.access_key, creds.secret_key, creds.project_id)
        self.client = (self._m.ModelArtsClient.new_builder().with_credentials(basic)
                       .with_endpoint(endpoint).with_http_config(cfg).build())

    # ------------------------------------------------------------------ calls
    def create(self, body: Dict[str, Any]) -> Dict[str, Any]:
        return self._call("create the training job",
                          lambda: self.client.create_training_job(self._m.CreateTrainingJobRequest(body=body)))

    def show(self, job_id: str) -> Dict[str, Any]:
        return self._call(f"show job {job_id}", lambda: self.client.show_training_job_details(
            self._m.ShowTrainingJobDetailsRequest(training_job_id=job_id)))

    def list(self, limit: int = 20, offset: int = 0) -> Dict[str, Any]:
        return self._call("list training jobs", lambda: self.client.list_training_jobs(
            self._m.ListTrainingJobsRequest(body=list_body(limit, offset))))

    def stop(self, job_id: str) -> Dict[str, Any]:
        return self._call(f"stop job {job_id}", lambda: self.client.stop_training_job(
            self._m.StopTrainingJobRequest(training_job_id=job_id, body=dict(STOP_BODY))))

    def logs(self, job_id: str, task_id: str = "worker-0") -> str:
        data = self._call(f"read the log of job {job_id} task {task_id}",
                          lambda: self.client.show_training_job_logs_preview(
                              self._m.ShowTrainingJobLogsPreviewRequest(training_job_id=job_id,
                                                                       task_id=task_id)))
        return str(data.get("content") or "")

    # ------------------------------------------------------------------ errors
    def _call(self, what: str, fn) -> Dict[str, Any]:
        exc_mod = require("huaweicloudsdkcore.exceptions.exceptions")
        try:
            resp = fn()
        except exc_mod.ServiceResponseException as exc:
            parts = [f"status {exc.status_code}"]
            for label, value in (("error_code", exc.error_code), ("error_msg", exc.error_msg),
                                 ("request_id", exc.request_id)):
                if value:
                    parts.append(f"{label} {value}")
            kind = "refused" if 400 <= int(exc.status_code or 0) < 500 else "failed on the platform side"
            raise UserError(self.creds.redact(f"ModelArts {kind} the request to {what}: " + ", ".join(parts)),
                            where=self.endpoint) from None
        except exc_mod.ConnectionException as exc:
            raise UserError(self.creds.redact(f"cannot connect to ModelArts to {what} "
                                              f"({exc.error_msg or exc}); check --endpoint/--region and the "
                                              "network"), where=self.endpoint) from None
        except exc_mod.SdkException as exc:
            raise UserError(self.creds.redact(f"ModelArts request to {what} failed: {exc}"),
                            where=self.endpoint) from None
        return resp.to_json_object() or {}
