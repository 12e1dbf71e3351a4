"""A loopback stand-in for the Hugging Face Hub, for tests: enough of its HTTP API for the real `huggingface_hub`
client (and transformers through it) to create repos and branches, commit (small files inline as base64, LFS ones
through the LFS batch API), read repo info and trees, resolve files and validate card metadata. It records every
request, so a test can tell what a client sent.

Not collected by pytest (no `test_` prefix); test modules start it with `running_hub()`.
"""

import base64
import hashlib
import json
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import yaml
from huggingface_hub import constants
from huggingface_hub.repocard import REGEX_YAML_BLOCK

TOKEN = "hf_fake_token_for_tests"
# The Hub's default .gitattributes sends these to LFS (a subset of its list).
LFS_EXTENSIONS = ("safetensors", "bin", "pt", "pth", "ckpt", "h5", "msgpack", "onnx", "gz", "zip")
GITATTRIBUTES = "".join(f"*.{ext} filter=lfs diff=lfs merge=lfs -text\n" for ext in LFS_EXTENSIONS).encode()
REGULAR_FILE_LIMIT = 10 * 1024 * 1024  # the Hub refuses larger non-LFS files
# Pipeline tags the Hub knows (a subset of its task list: the text tasks and a few others).
PIPELINE_TAGS = {
    "feature-extraction",
    "fill-mask",
    "text-classification",
    "token-classification",
    "question-answering",
    "sentence-similarity",
    "zero-shot-classification",
    "table-question-answering",
    "text-generation",
    "text2text-generation",
    "summarization",
    "translation",
    "text-ranking",
    "image-classification",
    "automatic-speech-recognition",
    "audio-classification",
    "object-detection",
    "image-segmentation",
}
LANGUAGE = re.compile(r"[a-z]{2,3}(-[A-Za-z0-9]{2,8})*|multilingual|code")
LICENSE = re.compile(r"[a-z0-9][a-z0-9.+-]*")
REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


@dataclass(frozen=True)
class Blob:
    content: bytes
    lfs: bool

    @property
    def git_oid(self) -> str:
        return hashlib.sha1(b"blob %d\0" % len(self.content) + self.content).hexdigest()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @property
    def oid(self) -> str:
        """What the client compares with its own file: the sha256 for LFS files, the git blob id otherwise."""
        return self.sha256 if self.lfs else self.git_oid


@dataclass
class Commit:
    id: str
    message: str
    files: dict  # path -> Blob


@dataclass
class Repo:
    private: bool
    branches: dict = field(default_factory=dict)  # name -> commit id
    commits: dict = field(default_factory=dict)  # id -> Commit

    def commit(self, revision: str) -> Commit | None:
        return self.commits.get(self.branches.get(revision, revision))

    def add_commit(self, parent: Commit | None, message: str, files: dict) -> Commit:
        digest = hashlib.sha1(f"{parent and parent.id}{message}{len(self.commits)}".encode())
        for path, blob in sorted(files.items()):
            digest.update(f"{path}\0{blob.oid}".encode())
        commit = Commit(digest.hexdigest(), message, files)
        self.commits[commit.id] = commit
        return commit


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    authorized: bool


class Reply(Exception):
    """A response, raised from anywhere in a handler."""

    def __init__(self, status: int, body=b"", headers=None, error_code: str | None = None):
        super().__init__(status)
        self.status, self.headers = status, dict(headers or {})
        if isinstance(body, (dict, list)):
            self.headers.setdefault("Content-Type", "application/json")
            body = json.dumps(body).encode()
        elif isinstance(body, str):
            self.headers.setdefault("Content-Type", "text/plain; charset=utf-8")
            body = body.encode()
        self.body = body
        if error_code:
            self.headers["X-Error-Code"] = error_code


def refuse(status: int, message: str, error_code: str | None = None, **headers):
    raise Reply(status, {"error": message}, {"X-Error-Message": message, **headers}, error_code)


def metadata_errors(metadata) -> list[str]:
    """The checks of the Hub's validate-yaml that matter for model cards (types, known tasks, id formats)."""
    if not isinstance(metadata, dict):
        return ["metadata must be a YAML mapping"]
    errors = []
    for key in ("tags", "datasets", "metrics"):
        value = metadata.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            errors.append(f'"{key}" must be a list of strings, got {value!r}')
    pipeline_tag = metadata.get("pipeline_tag")
    if pipeline_tag is not None and pipeline_tag not in PIPELINE_TAGS:
        errors.append(f'"pipeline_tag" must be a task the Hub knows, got {pipeline_tag!r}')
    for key, pattern in (("language", LANGUAGE), ("base_model", REPO_ID), ("license", LICENSE)):
        values = metadata.get(key)
        values = [values] if isinstance(values, str) else values
        if values is not None and not (
            isinstance(values, list) and values and all(isinstance(v, str) and pattern.fullmatch(v) for v in values)
        ):
            errors.append(f'"{key}" is not valid: {metadata[key]!r}')
    if metadata.get("license") == "other" and not (metadata.get("license_name") and metadata.get("license_link")):
        errors.append('"license: other" needs "license_name" and "license_link"')
    if "library_name" in metadata and not isinstance(metadata["library_name"], str):
        errors.append('"library_name" must be a string')
    return errors


class FakeHub:
    """The Hub's state (repos, LFS objects) and its API, one method per endpoint."""

    ROUTES = [
        ("POST", r"/api/repos/create", "create_repo"),
        ("POST", r"/api/validate-yaml", "validate_yaml"),
        ("GET", r"/api/agent-harnesses", "agent_harnesses"),
        ("POST", r"/api/models/(?P<repo_id>[^/]+/[^/]+)/preupload/(?P<revision>[^/]+)", "preupload"),
        ("POST", r"/api/models/(?P<repo_id>[^/]+/[^/]+)/commit/(?P<revision>[^/]+)", "commit"),
        ("POST", r"/api/models/(?P<repo_id>[^/]+/[^/]+)/branch/(?P<branch>[^/]+)", "create_branch"),
        ("POST", r"/(?P<repo_id>[^/]+/[^/]+)\.git/info/lfs/objects/batch", "lfs_batch"),
        ("PUT", r"/lfs-objects/(?P<oid>[0-9a-f]{64})", "lfs_upload"),
        ("GET", r"/api/models/(?P<repo_id>[^/]+/[^/]+)/tree/(?P<revision>[^/]+)(?:/(?P<path>.+))?", "tree"),
        ("GET", r"/api/models/(?P<repo_id>[^/]+/[^/]+)(?:/revision/(?P<revision>[^/]+))?", "model_info"),
        ("GET|HEAD", r"/(?P<repo_id>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<path>.+)", "resolve"),
    ]
    NEED_WRITE_ACCESS = {"create_repo", "preupload", "commit", "create_branch", "lfs_batch"}

    def __init__(self, url: str):
        self.url = url
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.requests: list[Request] = []
        self.lock = threading.Lock()

    def commits(self, repo_id: str) -> list[Commit]:
        return list(self.repos[repo_id].commits.values())

    def handle(self, method: str, target: str, headers, body: bytes) -> Reply:
        url = urlsplit(target)
        authorized = headers.get("Authorization") == f"Bearer {TOKEN}"
        with self.lock:
            self.requests.append(Request(method, url.path, authorized))
            try:
                for methods, pattern, name in self.ROUTES:
                    match = re.fullmatch(pattern, url.path)
                    if match and method in methods.split("|"):
                        if name in self.NEED_WRITE_ACCESS and not authorized:
                            refuse(401, "Invalid credentials in Authorization header")
                        arguments = {key: unquote(value) for key, value in match.groupdict().items() if value}
                        getattr(self, name)(
                            method=method, query=parse_qs(url.query), headers=headers, body=body, **arguments
                        )
                refuse(404, f"no such endpoint: {method} {url.path}")
            except Reply as reply:
                return reply
            except Exception as error:  # a bug here, or a request this fake does not understand
                return Reply(500, f"{type(error).__name__}: {error}")

    def readable_repo(self, repo_id: str, headers) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and headers.get("Authorization") != f"Bearer {TOKEN}"):
            refuse(404, "Repository not found", "RepoNotFound")
        return repo

    def revision(self, repo: Repo, revision: str) -> Commit:
        commit = repo.commit(revision)
        if commit is None:
            refuse(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    def create_repo(self, body, **_):
        request = json.loads(body)
        repo_id = f"{request.get('organization') or 'tester'}/{request['name']}"
        if request.get("type", "model") != "model":
            refuse(400, "this fake Hub holds model repos only")
        if repo_id in self.repos:
            raise Reply(409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"})
        repo = self.repos[repo_id] = Repo(private=request.get("visibility") == "private")
        initial = repo.add_commit(None, "initial commit", {".gitattributes": Blob(GITATTRIBUTES, lfs=False)})
        repo.branches["main"] = initial.id
        raise Reply(200, {"url": f"{self.url}/{repo_id}", "name": repo_id})

    def agent_harnesses(self, **_):
        # huggingface_hub fetches this registry (to tag requests made by AI agents) before its first request.
        raise Reply(200, {"standardEnvVars": [], "harnesses": {}})

    def validate_yaml(self, body, headers, **_):
        match = REGEX_YAML_BLOCK.search(json.loads(body)["content"])
        if match is None:
            raise Reply(200, {"errors": [], "warnings": [{"message": "empty or missing yaml metadata in repo card"}]})
        try:
            errors = metadata_errors(yaml.safe_load(match.group(2)))
        except yaml.YAMLError as error:
            errors = [f"YAML is not valid: {error}"]
        if not errors:
            raise Reply(200, {"errors": [], "warnings": []})
        if "text/plain" in headers.get("Accept", ""):  # what ModelCard.validate asks for
            raise Reply(400, "\n".join(errors))
        raise Reply(400, {"errors": [{"message": message} for message in errors], "warnings": []})

    def preupload(self, repo_id, revision, body, headers, **_):
        head = self.revision(self.readable_repo(repo_id, headers), revision)
        files = []
        for item in json.loads(body)["files"]:
            lfs = item["path"].endswith(tuple("." + ext for ext in LFS_EXTENSIONS)) or item["size"] > REGULAR_FILE_LIMIT
            existing = head.files.get(item["path"])
            files.append(
                {
                    "path": item["path"],
                    "uploadMode": "lfs" if lfs else "regular",
                    "shouldIgnore": False,
                    "oid": existing.oid if existing is not None and existing.lfs == lfs else None,
                }
            )
        raise Reply(200, {"files": files, "commitOid": head.id})

    def lfs_batch(self, repo_id, body, headers, **_):
        self.readable_repo(repo_id, headers)
        request = json.loads(body)
        if request.get("operation") != "upload" or "basic" not in request.get("transfers", ["basic"]):
            refuse(400, "this fake Hub takes basic LFS uploads only")
        objects = []
        for item in request["objects"]:
            upload = {"upload": {"href": f"{self.url}/lfs-objects/{item['oid']}"}}
            objects.append(
                {
                    "oid": item["oid"],
                    "size": item["size"],
                    "authenticated": True,
                    **({} if item["oid"] in self.lfs else {"actions": upload}),
                }
            )
        raise Reply(
            200,
            {"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
            {"Content-Type": "application/vnd.git-lfs+json"},
        )

    def lfs_upload(self, oid, body, **_):
        # The upload URL stands for a pre-signed storage URL: it carries no Hub credentials.
        if hashlib.sha256(body).hexdigest() != oid:
            refuse(400, "content does not match its sha256")
        self.lfs[oid] = body
        raise Reply(200)

    def commit(self, repo_id, revision, query, body, headers, **_):
        repo = self.readable_repo(repo_id, headers)
        if query.get("create_pr"):
            refuse(400, "this fake Hub does not open pull requests")
        if revision not in repo.branches:
            refuse(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        head = repo.commit(revision)
        files, message = dict(head.files), None
        for line in body.splitlines():
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                message = value["summary"]
            elif key == "file":
                content = base64.b64decode(value["content"])
                if len(content) > REGULAR_FILE_LIMIT:
                    refuse(400, f"{value['path']} is larger than 10 MiB: it must go through LFS")
                files[value["path"]] = Blob(content, lfs=False)
            elif key == "lfsFile":
                if value["oid"] not in self.lfs:
                    refuse(400, f"{value['path']}: LFS object {value['oid']} was never uploaded")
                files[value["path"]] = Blob(self.lfs[value["oid"]], lfs=True)
            else:
                refuse(400, f"this fake Hub does not take {key!r} operations")
        commit = repo.add_commit(head, message, files)
        repo.branches[revision] = commit.id
        raise Reply(
            200, {"success": True, "commitOid": commit.id, "commitUrl": f"{self.url}/{repo_id}/commit/{commit.id}"}
        )

    def create_branch(self, repo_id, branch, body, headers, **_):
        repo = self.readable_repo(repo_id, headers)
        if branch in repo.branches:
            refuse(409, "Reference already exists")
        repo.branches[branch] = self.revision(repo, json.loads(body or b"{}").get("startingPoint", "main")).id
        raise Reply(200, {})

    def model_info(self, repo_id, headers, revision="main", **_):
        repo = self.readable_repo(repo_id, headers)
        commit = self.revision(repo, revision)
        card = commit.files.get("README.md")
        match = card and REGEX_YAML_BLOCK.search(card.content.decode())
        card_data = (yaml.safe_load(match.group(2)) if match else None) or {}
        raise Reply(
            200,
            {
                "id": repo_id,
                "sha": commit.id,
                "private": repo.private,
                "cardData": card_data,
                "tags": card_data.get("tags", []),
                "pipeline_tag": card_data.get("pipeline_tag"),
                "library_name": card_data.get("library_name"),
                "siblings": [{"rfilename": path} for path in sorted(commit.files)],
            },
        )

    def tree(self, repo_id, revision, query, headers, path="", **_):
        commit = self.revision(self.readable_repo(repo_id, headers), revision)
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        entries = {}
        for name, blob in sorted(commit.files.items()):
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix) :].split("/")
            for depth in range(1, len(parts)):
                folder = prefix + "/".join(parts[:depth])
                if recursive or depth == 1:
                    entries[folder] = {"type": "directory", "oid": "0" * 40, "size": 0, "path": folder}
            if recursive or len(parts) == 1:
                entries[name] = {
                    "type": "file",
                    "oid": blob.git_oid,
                    "size": len(blob.content),
                    "path": name,
                    **(
                        {"lfs": {"oid": blob.sha256, "size": len(blob.content), "pointerSize": 134}} if blob.lfs else {}
                    ),
                }
        if prefix and not entries:
            refuse(404, f"{path} does not exist on {revision}", "EntryNotFound")
        raise Reply(200, list(entries.values()))

    def resolve(self, method, repo_id, revision, path, headers, **_):
        commit = self.revision(self.readable_repo(repo_id, headers), revision)
        blob = commit.files.get(path)
        if blob is None:
            refuse(404, "Entry not found", "EntryNotFound", **{"X-Repo-Commit": commit.id})
        found = {"ETag": f'"{blob.git_oid}"', "X-Repo-Commit": commit.id, "Content-Type": "application/octet-stream"}
        if blob.lfs:
            found.update({"X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": str(len(blob.content))})
        raise Reply(200, b"" if method == "HEAD" else blob.content, {**found, "Content-Length": str(len(blob.content))})


def handler_for(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                self.rfile.readline()
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def answer(self):
            body = b"" if self.command == "HEAD" else self.read_body()
            reply = hub.handle(self.command, self.path, self.headers, body)
            self.send_response(reply.status)
            for name, value in reply.headers.items():
                self.send_header(name, value)
            if "Content-Length" not in reply.headers:
                self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(reply.body)

        do_GET = do_HEAD = do_POST = do_PUT = answer

        def log_message(self, *args):
            pass

    return Handler


@contextmanager
def running_hub():
    """A FakeHub on 127.0.0.1 at a free port, served by a thread, for the duration of the block."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), None)
    hub = FakeHub(f"http://127.0.0.1:{server.server_address[1]}")
    server.RequestHandlerClass = handler_for(hub)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def client_environment(hub: FakeHub, home: Path) -> dict:
    """Environment for a process that talks to `hub`, with an empty Hugging Face home of its own."""
    return {
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "HF_TOKEN": TOKEN,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        # hf_xet would send LFS files to a Xet storage service, which this fake does not emulate.
        "HF_HUB_DISABLE_XET": "1",
    }


@contextmanager
def client_pointed_at(hub: FakeHub, home: Path):
    """Point this process's huggingface_hub (and transformers) at `hub`. huggingface_hub read HF_ENDPOINT and its
    other settings into module constants when first imported, so those are patched as well as the environment."""
    import transformers.utils.hub

    environment = client_environment(hub, home)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environment.items():
            patch.setenv(name, value)
        patch.setattr(constants, "ENDPOINT", hub.url)
        patch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        patch.setattr(constants, "HF_HUB_OFFLINE", False)
        patch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        real_home = constants.HF_HOME
        for name, value in list(vars(constants).items()):  # caches, token, agent registry: all under HF_HOME
            if isinstance(value, str) and value.startswith(real_home):
                patch.setattr(constants, name, str(home) + value[len(real_home) :])
        patch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
        patch.setattr(transformers.utils.hub, "_hf_api", None)  # an HfApi made with the old endpoint
        yield hub
