"""Find the real ComfyUI; set it up in this process, or run it headless on CPU as a server, with
the pack installed."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from qwen_turbo.cli.comfy_home import HOW_TO_PROVIDE, find_comfyui

from . import pack
from .pack import ROOT

COMFY = find_comfyui()  # None where there is none: conftest stops the run, setup_comfy exits


def setup_comfy(**flags):
    """ComfyUI in this process: on sys.path, its launch flags set (`args.cpu` without CUDA,
    then `flags`), the pack loaded."""
    if COMFY is None:
        sys.exit(HOW_TO_PROVIDE)
    sys.path.insert(0, str(COMFY))
    import torch
    from comfy.cli_args import args

    args.cpu = not torch.cuda.is_available()
    for name, value in flags.items():
        setattr(args, name, value)
    pack.load()


def _error_text(entry: dict) -> str:
    for kind, data in entry["status"].get("messages", []):
        if kind == "execution_error":
            trace = "".join(data.get("traceback", []))[-3000:]
            return (
                f"node {data.get('node_id')} ({data.get('node_type')}): "
                f"{data.get('exception_type')}: {data.get('exception_message')}\n{trace}"
            )
    return json.dumps(entry["status"])[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ComfyServer:
    """ComfyUI's main.py on loopback, CPU only, in a throwaway base directory.

    custom_nodes/ holds links to this pack and to tests/testing_nodes; models/ links to the
    tiny-model cache. Nothing is written into the ComfyUI checkout.
    """

    def __init__(self, comfy: Path, base: Path, models: Path):
        self.comfy, self.base = comfy, base
        nodes = base / "custom_nodes"
        nodes.mkdir(parents=True)
        (nodes / "qwen_turbo").symlink_to(ROOT, target_is_directory=True)
        (nodes / "qwen_turbo_testing").symlink_to(ROOT / "tests" / "testing_nodes")
        (base / "models").symlink_to(models, target_is_directory=True)
        self.output = base / "output"
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = base / "comfyui.log"
        self.proc = None

    def start(self, timeout: float = 180.0) -> None:
        cmd = [
            sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1",
            "--port", str(self.port), "--base-directory", str(self.base),
            "--database-url", "sqlite:///:memory:", "--disable-auto-launch",
        ]  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, cwd=self.comfy, stdout=self.log, stderr=subprocess.STDOUT, env=env
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited at start:\n{self.log_text()[-4000:]}")
            try:
                self.get("/system_stats")
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        raise TimeoutError(f"ComfyUI did not answer in {timeout}s:\n{self.log_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict):
        req = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                data = r.read()
                return json.loads(data) if data else None  # /settings answers with no body
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"POST {path} -> {e.code}: {e.read().decode()}") from e

    def run(
        self,
        prompt: dict,
        timeout: float = 600.0,
        client_id: str = "qwen-turbo-tests",
        extra_data: dict | None = None,
    ) -> dict:
        """Queue an API-format prompt and wait; returns its history entry. Progress messages
        go to the websocket client `client_id` (a browser page's, to see them there);
        `extra_data` is what the frontend sends beside the prompt (the workflow)."""
        body = {"prompt": prompt, "client_id": client_id, "extra_data": extra_data or {}}
        pid = self.post("/prompt", body)["prompt_id"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hist = self.get(f"/history/{pid}")
            if pid in hist and hist[pid].get("status", {}).get("completed") is not None:
                entry = hist[pid]
                if entry["status"]["status_str"] != "success":
                    raise RuntimeError(f"prompt failed:\n{_error_text(entry)}")
                return entry
            if self.proc.poll() is not None:
                raise RuntimeError(f"ComfyUI died:\n{self.log_text()[-4000:]}")
            time.sleep(0.2)
        raise TimeoutError(f"prompt {pid} did not finish in {timeout}s")

    def images(self, entry: dict, node_id: str) -> list[Path]:
        return [
            self.output / img["subfolder"] / img["filename"]
            for img in entry["outputs"][node_id]["images"]
        ]
