"""A recording stand-in for the ModelArts v2 training-job API and the OBS object API.

Binds 127.0.0.1 on a free port in a background thread.  Every request is kept as a
:class:`Recorded` (method, path, query, headers, body).  ``fail`` maps
``(METHOD, path-prefix)`` to ``(status, json body)`` to inject platform errors.
Objects uploaded to OBS (single PUT or multipart) are assembled in ``objects``.
"""
from __future__ import annotations

import http.server
import json
import threading
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple


@dataclass
class Recorded:
    method: str
    path: str
    query: Dict[str, List[str]]
    headers: Dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body.decode("utf-8"))


class FakeCloud:
    def __init__(self):
        self.requests: List[Recorded] = []
        self.fail: Dict[Tuple[str, str], Tuple[int, dict]] = {}
        self.objects: Dict[str, bytes] = {}          # "bucket/key" -> bytes
        self.parts: Dict[str, Dict[int, bytes]] = {}  # upload id -> part number -> bytes
        self.jobs: Dict[str, dict] = {}
        self.lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()

    def find(self, method: str, path_part: str = "") -> List[Recorded]:
        return [r for r in self.requests if r.method == method and path_part in r.path]

    # ------------------------------------------------------------------ handler
    def _handler(self):
        cloud = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output clean
                pass

            def _serve(self):
                parsed = urllib.parse.urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                rec = Recorded(self.command, parsed.path, urllib.parse.parse_qs(parsed.query,
                                                                               keep_blank_values=True),
                               {k: v for k, v in self.headers.items()}, body)
                with cloud.lock:
                    cloud.requests.append(rec)
                for (method, prefix), (status, payload) in cloud.fail.items():
                    if method == rec.method and rec.path.startswith(prefix):
                        return self._reply(status, json.dumps(payload).encode(), "application/json",
                                           {"X-Request-Id": "req-fake-4xx"})
                if rec.path.startswith("/v2/"):
                    return cloud._modelarts(self, rec)
                return cloud._obs(self, rec)

            def _reply(self, status, data=b"", ctype="application/json", headers=None):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve

        return Handler

    # ------------------------------------------------------------------ ModelArts v2
    def _modelarts(self, h, rec: Recorded):
        parts = rec.path.strip("/").split("/")   # v2, pid, ...
        rest = parts[2:]
        if rec.method == "POST" and rest == ["training-jobs"]:
            job = rec.json()
            job_id = "job-" + uuid.uuid4().hex[:8]
            job["metadata"] = dict(job.get("metadata", {}), id=job_id, create_time=1700000000000)
            job["status"] = {"phase": "Creating", "secondary_phase": "Creating", "duration": 0}
            with self.lock:
                self.jobs[job_id] = job
            return h._reply(201, json.dumps(job).encode())
        if rec.method == "POST" and rest == ["training-job-searches"]:
            items = list(self.jobs.values())
            return h._reply(200, json.dumps({"total": len(items), "count": len(items), "limit": 10,
                                             "offset": 0, "items": items}).encode())
        if len(rest) >= 2 and rest[0] == "training-jobs":
            job = self.jobs.get(rest[1])
            if job is None:
                return h._reply(404, json.dumps({"error_code": "ModelArts.2762",
                                                 "error_msg": f"job {rest[1]} not found"}).encode(),
                                headers={"X-Request-Id": "req-fake-404"})
            if rec.method == "GET" and len(rest) == 2:
                shown = dict(job, status={"phase": "Running", "secondary_phase": "Running",
                                          "duration": 61000, "tasks": ["worker-0", "worker-1"]})
                return h._reply(200, json.dumps(shown).encode())
            if rec.method == "POST" and rest[2:] == ["actions"]:
                job["status"] = {"phase": "Terminating"}
                return h._reply(202, json.dumps({"kind": "job", "metadata": job["metadata"],
                                                 "status": job["status"]}).encode())
            if rec.method == "GET" and rest[2:3] == ["tasks"] and rest[-2:] == ["logs", "preview"]:
                text = f"log of {rest[1]} task {rest[3]}\nstep 1 loss 10.4\n"
                return h._reply(200, json.dumps({"content": text, "current_size": len(text),
                                                 "full_size": len(text)}).encode())
        return h._reply(404, json.dumps({"error_code": "ModelArts.0404", "error_msg": "no route"}).encode())

    # ------------------------------------------------------------------ OBS (path style)
    def _obs(self, h, rec: Recorded):
        key = urllib.parse.unquote(rec.path.lstrip("/"))
        q = rec.query
        xml = "application/xml"
        if rec.method == "POST" and "uploads" in q:
            upload_id = "up-" + uuid.uuid4().hex[:8]
            with self.lock:
                self.parts[upload_id] = {}
            bucket, _, obj = key.partition("/")
            return h._reply(200, (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?><InitiateMultipartUploadResult>"
                                  f"<Bucket>{bucket}</Bucket><Key>{obj}</Key><UploadId>{upload_id}</UploadId>"
                                  f"</InitiateMultipartUploadResult>").encode(), xml)
        if rec.method == "PUT" and "partNumber" in q:
            upload_id, number = q["uploadId"][0], int(q["partNumber"][0])
            with self.lock:
                self.parts[upload_id][number] = rec.body
            return h._reply(200, b"", xml, {"ETag": f'"etag-{number}"'})
        if rec.method == "POST" and "uploadId" in q:
            upload_id = q["uploadId"][0]
            parts = self.parts.pop(upload_id)
            with self.lock:
                self.objects[key] = b"".join(parts[n] for n in sorted(parts))
            bucket, _, obj = key.partition("/")
            return h._reply(200, (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?><CompleteMultipartUploadResult>"
                                  f"<Location>/{key}</Location><Bucket>{bucket}</Bucket><Key>{obj}</Key>"
                                  f"<ETag>\"etag-all\"</ETag></CompleteMultipartUploadResult>").encode(), xml)
        if rec.method == "PUT":
            with self.lock:
                self.objects[key] = rec.body
            return h._reply(200, b"", xml, {"ETag": '"etag-single"'})
        if rec.method == "HEAD" and "/" not in key.rstrip("/"):
            return h._reply(200, b"", xml)    # headBucket: every bucket exists
        if rec.method in ("HEAD", "GET"):
            if key in self.objects:
                return h._reply(200, self.objects[key], "application/octet-stream")
            return h._reply(404, b"", xml)
        return h._reply(405, b"", xml)
