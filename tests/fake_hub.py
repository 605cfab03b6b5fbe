"""A stand-in for the Hugging Face Hub on loopback: records what huggingface_hub sends when it
creates a repository and commits files. Every file is asked to be sent inline ("regular"
mode), or with ``lfs=True`` the ``.safetensors`` files go through the LFS batch API and one PUT
each (basic transfer; tests then turn Xet off, ``HF_HUB_DISABLE_XET``). Used through
``HF_ENDPOINT``; no test reaches a network."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    """``with FakeHub() as hub:`` -> ``hub.url``; afterwards ``hub.repos`` (create requests),
    ``hub.commits`` (dicts with ``repo``, ``revision``, ``header``, ``files``: path -> bytes),
    ``hub.auth`` (Authorization headers seen), ``hub.paths`` (every request line), ``hub.lfs``
    (sha256 -> bytes stored by PUT), ``hub.puts`` (sha256 of every PUT, in order)."""

    def __init__(self, fail_commits: int = 0, lfs: bool = False):
        self.repos: list[dict] = []
        self.commits: list[dict] = []
        self.auth: list[str] = []
        self.paths: list[str] = []
        self.branches: list[str] = []
        self.cards: list[dict] = []
        self.fail_commits = fail_commits
        self.lfs: dict[str, bytes] = {}
        self.puts: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _json(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while n := int(self.rfile.readline().split(b";")[0], 16):
                        out += self.rfile.read(n)
                        self.rfile.readline()
                    self.rfile.readline()
                    return out
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n)

            def do_PUT(self):  # an LFS object (the href the batch answer gave)
                hub.paths.append(f"PUT {self.path}")
                body = self._body()
                oid = self.path.rsplit("/", 1)[-1]
                assert hashlib.sha256(body).hexdigest() == oid
                hub.lfs[oid] = body
                hub.puts.append(oid)
                self._json(200, {})

            def do_GET(self):
                hub.paths.append(f"GET {self.path}")
                parts = self.path.split("?")[0].strip("/").split("/")
                if len(parts) == 6 and parts[:2] == ["api", "models"] and parts[4] == "revision":
                    # repo_info, which upload_large_folder asks (before huggingface_hub 1.20)
                    return self._json(200, {"id": f"{parts[2]}/{parts[3]}", "sha": "a" * 40,
                                            "xetEnabled": False, "siblings": []})
                self._json(404, {"error": "not found"})

            def do_POST(self):
                hub.paths.append(f"POST {self.path}")
                hub.auth.append(self.headers.get("Authorization", ""))
                body = self._body()
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:3] == ["api", "repos", "create"]:
                    req = json.loads(body)
                    hub.repos.append(req)
                    name = f"{req.get('organization') or 'user'}/{req['name']}"
                    return self._json(200, {"url": f"{hub.url}/{name}", "name": name})
                if parts[:2] == ["api", "validate-yaml"]:  # model cards' metadata
                    hub.cards.append(json.loads(body))
                    return self._json(200, {"errors": [], "warnings": []})
                if len(parts) >= 6 and parts[0] == "api" and parts[4] == "branch":
                    hub.branches.append(f"{parts[2]}/{parts[3]}@{parts[5]}")
                    return self._json(200, {})
                if len(parts) >= 6 and parts[0] == "api" and parts[4] == "preupload":
                    files = json.loads(body).get("files", [])
                    return self._json(200, {"files": [
                        {"path": f["path"], "shouldIgnore": False, "uploadMode":
                         "lfs" if lfs and f["path"].endswith(".safetensors") else "regular"}
                        for f in files]})
                if self.path.endswith(".git/info/lfs/objects/batch"):
                    objects = [{"oid": o["oid"], "size": o["size"]}
                               for o in json.loads(body)["objects"]]
                    for o in objects:  # no "actions": already stored, nothing to send
                        if o["oid"] not in hub.lfs:
                            o["actions"] = {"upload": {"href": f"{hub.url}/lfs/{o['oid']}"}}
                    return self._json(200, {"transfer": "basic", "objects": objects})
                if len(parts) >= 6 and parts[0] == "api" and parts[4] == "commit":
                    if hub.fail_commits > 0:
                        hub.fail_commits -= 1
                        return self._json(500, {"error": "the hub is down"})
                    commit = {"repo": f"{parts[2]}/{parts[3]}", "revision": parts[5],
                              "files": {}}
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item["key"] == "header":
                            commit["header"] = item["value"]
                        elif item["key"] == "file":
                            v = item["value"]
                            commit["files"][v["path"]] = base64.b64decode(v["content"])
                        elif item["key"] == "lfsFile":
                            v = item["value"]
                            commit["files"][v["path"]] = hub.lfs[v["oid"]]
                    hub.commits.append(commit)
                    return self._json(200, {"commitUrl": f"{hub.url}/{commit['repo']}/commit/"
                                            + "a" * 40, "commitOid": "a" * 40})
                self._json(404, {"error": f"unknown endpoint {self.path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
