"""The far end of `wandb sync` for tests: an HTTP server on 127.0.0.1 that answers the few W&B API calls the sync
makes (GraphQL UpsertBucket and CreateRunFiles, the run's file stream, file uploads) and records what arrives. W&B's
own server cannot run here; the reading of titan's run file, and what is sent from it, is W&B's client's own work."""
import http.server
import json
import os
import re
import subprocess
import sys
import threading


class Recorder:
    def __init__(self):
        self.graphql = []      # (operation name, variables)
        self.file_stream = []  # the JSON bodies posted to .../file_stream
        self.uploads = {}      # file name -> bytes
        self.history_lines = {}  # run id -> the history rows received, which a resumed run continues after
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def reply(self, obj):
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def body(self):
                return self.rfile.read(int(self.headers.get("Content-Length", 0)))

            def do_POST(self):
                data = self.body()
                if self.path.startswith("/graphql"):
                    query = json.loads(data)
                    m = re.search(r"(?:query|mutation)\s+(\w+)", query["query"])
                    name, variables = (m.group(1) if m else "?"), query.get("variables") or {}
                    recorder.graphql.append((name, variables))
                    if name == "UpsertBucket":
                        project = {"id": "UHJvamVjdDox", "name": variables.get("project"),
                                   "entity": {"id": "RW50aXR5OjE=", "name": variables.get("entity") or "titan-test"}}
                        return self.reply({"data": {"upsertBucket": {"inserted": True, "bucket": {
                            "id": "UnVuOjE=", "name": variables.get("name"), "displayName": variables.get("displayName"),
                            "description": "", "config": "{}", "sweepName": None, "historyLineCount": 0,
                            "project": project}}}})
                    if name == "RunResumeStatus":  # what W&B's server knows of the run, for a resumed one
                        rows = recorder.history_lines.get(variables.get("name"), [])
                        bucket = None if not rows else {
                            "id": "UnVuOjE=", "name": variables["name"], "summaryMetrics": json.dumps(rows[-1]),
                            "displayName": variables["name"], "logLineCount": 0, "historyLineCount": len(rows),
                            "eventsLineCount": 0, "historyTail": json.dumps([json.dumps(rows[-1])]), "eventsTail": "[]",
                            "config": "{}", "tags": [], "notes": None,
                            "wandbConfig": json.dumps({"t": {"3": [76]}})}  # "t" marks a run that has started
                        return self.reply({"data": {"model": {"id": "UHJvamVjdDox", "name": variables.get("project"), "entity": {
                            "id": "RW50aXR5OjE=", "name": variables.get("entity") or "titan-test"}, "bucket": bucket}}})
                    if name == "CreateRunFiles":
                        port = self.server.server_address[1]
                        return self.reply({"data": {"createRunFiles": {"runID": "UnVuOjE=", "uploadHeaders": [], "files": [
                            {"name": f, "uploadUrl": f"http://127.0.0.1:{port}/upload/{f}"} for f in variables["files"]]}}})
                    return self.reply({"data": {}})
                if self.path.endswith("/file_stream"):
                    post = json.loads(data)
                    recorder.file_stream.append(post)
                    history = post.get("files", {}).get("wandb-history.jsonl")
                    if history:  # the server stores the rows at the offset the client gives
                        rows = recorder.history_lines.setdefault(self.path.split("/")[-2], [])
                        del rows[history["offset"]:]
                        rows += [json.loads(line) for line in history["content"]]
                    return self.reply({"exitcode": None, "limits": {}})
                return self.reply({})

            def do_PUT(self):
                recorder.uploads[self.path.rsplit("/", 1)[-1]] = self.body()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def sync(self, run_directory, home):
        """`wandb sync` of one offline run directory (or a list of them) to this server; W&B's settings and caches go
        under `home`."""
        wandb = os.path.join(os.path.dirname(sys.executable), "wandb")
        env = dict(os.environ, WANDB_BASE_URL=self.url, WANDB_API_KEY="t" * 40, HOME=str(home),
                   WANDB_CONFIG_DIR=str(home / "config"), WANDB_CACHE_DIR=str(home / "cache"), WANDB_SILENT="true")
        for name in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID"):
            env.pop(name, None)
        directories = run_directory if isinstance(run_directory, (list, tuple)) else [run_directory]
        return subprocess.run([wandb, "sync", *map(str, directories)], env=env, capture_output=True, text=True, timeout=300,
                              cwd=home)  # its own logs go to ./wandb

    def upserts(self):
        return [v for name, v in self.graphql if name == "UpsertBucket"]

    def history(self):
        """Every history row the sync streamed, in order."""
        rows = []
        for post in self.file_stream:
            rows += [json.loads(line) for line in post.get("files", {}).get("wandb-history.jsonl", {}).get("content", [])]
        return rows

    def summary(self):
        last = {}
        for post in self.file_stream:
            for line in post.get("files", {}).get("wandb-summary.json", {}).get("content", []):
                last = json.loads(line)
        return last

    def exit_code(self):
        codes = [post["exitcode"] for post in self.file_stream if "exitcode" in post]
        return codes[-1] if codes else None
