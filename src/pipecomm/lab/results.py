"""Results on disk: atomic writes, environment records, the layout of ``docs/results_layout.md``.

``results/<profile>/<E>/`` holds ``data.csv`` (tidy, one row per measurement), ``figure.png`` and
``figure.pdf``, the executed ``notebook.ipynb``, ``params.json`` and ``env.json``. Every file is
written to a temporary name and renamed into place; a whole experiment directory is assembled in a
temporary directory and renamed, so an interrupted run never leaves a half-written result.

Example::

    >>> import tempfile
    >>> import pandas as pd
    >>> from pipecomm.lab import results
    >>> out_dir, df, fig, params = tempfile.mkdtemp(), pd.DataFrame({"time_s": [0.1]}), None, {}
    >>> out = results.save(out_dir, df, fig, params)   # data.csv, figure.png/.pdf, params.json
    >>> sorted(p.name for p in out.iterdir())
    ['data.csv', 'env.json', 'params.json']
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

REPO_ROOT = Path(__file__).resolve().parents[3]
"""The checkout this package was installed from (editable install) — where results/ lives."""

NETWORK_COLUMN = "network"
"""Every data.csv says which network: "real", netem's "emulated, ..." text, a virtual cluster's
"shaped: Linux tc tbf, real TCP; ..." text, or "analytic ..."."""
NETWORK_KINDS = ("real", "emulated", "shaped", "analytic")


def network_kind(text: Any) -> str:
    """The kind of a ``network`` column's text: ``"real"``, ``"emulated"`` (pipecomm.lab.networks.netem),
    ``"shaped"`` (a real network shaped by Linux tc) or ``"analytic"``.

    Example::

        >>> network_kind("shaped: Linux tc tbf, real TCP; 8 nodes x 1 rank, ...")
        'shaped'
    """
    head = (str(text).split() or [""])[0].rstrip(":,")
    if head not in NETWORK_KINDS:
        raise ValueError(f"network {text!r} is none of {NETWORK_KINDS}")
    return head


# --------------------------------------------------------------------------- atomic writes


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` if the block succeeds.

    Example::

        >>> import os, tempfile
        >>> import pandas as pd
        >>> df, out = pd.DataFrame({"time_s": [0.1, 0.2]}), tempfile.mkdtemp()
        >>> with atomic_path(os.path.join(out, "data.csv")) as tmp:
        ...     df.to_csv(tmp, index=False)
        >>> os.listdir(out)
        ['data.csv']
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a written file follows the umask
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise type(exc)(exc.errno, exc.strerror, str(path)) from exc  # the error names the file
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def _umask() -> int:
    """This process's umask (read from /proc where it can be, else set and restored)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically write ``text`` to ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Atomically write ``data`` to ``path``."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically write ``obj`` as indented JSON (numpy scalars converted)."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def json_roundtrip(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples become lists), for comparisons."""
    return json.loads(json.dumps(obj, default=_json_default))


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot write {type(obj).__name__} to JSON")


def write_csv(path: str | os.PathLike, df: pd.DataFrame) -> None:
    """Atomically write a tidy DataFrame as CSV."""
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)


def replace_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Move a completed ``tmp_dir`` onto ``final_dir`` (replacing an older result) by renames."""
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if final_dir.exists():
        old = final_dir.with_name(f".{final_dir.name}.old-{os.getpid()}")
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- resumable runs

RUNS_ENV = "PIPECOMM_RUNS_DIR"
"""Set by the orchestrator (``pipecomm.lab.artifact``) to a directory that outlives an interrupted
experiment: :class:`Runs` keeps each finished run there, and ``progress.json`` for the
orchestrator's progress bar. Unset (a notebook opened by hand), runs are not kept."""


class Runs:
    """The training runs of one experiment, resumable run by run, with a progress bar.

    ``runs(key, fn, *args)`` returns ``fn(*args)``; when :data:`RUNS_ENV` names a directory, the
    result is pickled there under a hash of ``key`` (written atomically), so re-running an
    interrupted experiment skips the runs already done. Each call also updates a tqdm bar (time
    remaining from the mean time of the runs done so far) and ``progress.json``. The bar is
    plain tqdm on stderr (never tqdm's notebook widget, whose fallback is a warning), shown only
    on a terminal: in a notebook (stderr is no terminal there) and under the orchestrator
    (:data:`RUNS_ENV` set, whose own bar reads ``progress.json``) :meth:`close` prints one line
    instead (``E13 runs: 30 runs in 1.1 min (0 reused)``), so a stored notebook holds no
    progress bar.

    Example::

        >>> from pipecomm.lab import results
        >>> def run_all(configs):
        ...     runs = results.Runs(total=len(configs), desc="E13 runs")
        ...     out = [runs(cfg, pow, cfg, 10) for cfg in configs]   # runs(cfg, ranks.run, train_rank, cfg)
        ...     runs.close()
        ...     return out
        >>> run_all([2, 3])   # a bar on a terminal's stderr, else one line
        E13 runs: 2 runs in 0 s (0 reused)
        [1024, 59049]
    """

    def __init__(self, total: int, desc: str = "runs", directory: str | os.PathLike | None = None):
        from tqdm.std import tqdm

        directory = directory or os.environ.get(RUNS_ENV)
        self.dir = Path(directory) if directory else None
        self.total, self.done, self.ran_s, self.ran = total, 0, 0.0, 0
        self.desc, self.started = desc, time.perf_counter()
        quiet = RUNS_ENV in os.environ or not _is_terminal(sys.stderr)
        self.bar = tqdm(total=total, desc=desc, unit="run", file=sys.stderr, disable=quiet,
                        mininterval=1.0)

    def __call__(self, key: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        import pickle

        path = None
        if self.dir is not None:
            digest = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode())
            path = self.dir / f"{digest.hexdigest()[:20]}.pkl"
            if path.exists():
                try:
                    with open(path, "rb") as f:
                        value = pickle.load(f)
                except Exception:  # damaged (cut, overwritten): never reused, run again
                    path.unlink(missing_ok=True)
                else:
                    self._advance(0.0)
                    return value
        t0 = time.perf_counter()
        value = fn(*args, **kwargs)
        if path is not None:
            with atomic_path(path) as tmp, open(tmp, "wb") as f:
                pickle.dump(value, f)
        self._advance(time.perf_counter() - t0)
        return value

    def _advance(self, seconds: float) -> None:
        self.done += 1
        if seconds:
            self.ran_s, self.ran = self.ran_s + seconds, self.ran + 1
        self.bar.update(1)
        if self.dir is not None:
            left = (self.total - self.done) * (self.ran_s / self.ran if self.ran else 0.0)
            write_json(self.dir / "progress.json",
                       {"done": self.done, "total": self.total, "remaining_s": left})

    def close(self) -> None:
        """End the bar; without one, print the one line that sums the runs up."""
        self.bar.close()
        if self.bar.disable:
            took = time.perf_counter() - self.started
            when = f"{took:.0f} s" if took < 120 else f"{took / 60:.1f} min"
            print(f"{self.desc}: {self.done} runs in {when} ({self.done - self.ran} reused)")


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


# --------------------------------------------------------------------------- provenance


def git_commit(root: Path = REPO_ROOT) -> str:
    """HEAD's commit, with ``+dirty-<hash of the diff>`` when the code differs from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=20, check=True
        ).stdout

    try:
        head = git("rev-parse", "HEAD").strip()
        diff = git("diff", "HEAD", "--", "src", "notebooks", "artifact/profiles",
                   "artifact/claims.yaml")
    except Exception:
        return "unknown"
    if diff:
        head += "+dirty-" + hashlib.sha1(diff.encode()).hexdigest()[:10]
    return head


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """Versions and hardware of this process: python, torch, pipecomm, git, CPU/GPU.

    Example::

        >>> from pipecomm.lab import results
        >>> env = results.environment()   # {"torch": "2.13.0+cpu", "cpu_count": 2, ...}
        >>> {"python", "torch", "cpu_count"} <= set(env)
        True
    """
    import torch

    import pipecomm

    gpus, nccl = [], None
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        with contextlib.suppress(Exception):
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "pipecomm": pipecomm.__version__,
        **{name: _version(name) for name in ("numpy", "scipy", "pandas", "papermill")},
        "git_commit": git_commit(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpus": gpus,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        **installed_set(),
    }


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_set() -> dict[str, str]:
    """Hashes that identify the software a run used: ``lock_sha256`` of
    ``artifact/requirements-lock.txt`` (what set-up installs) and ``installed_sha256`` of the
    sorted ``name==version`` of every installed distribution (what ``pip freeze`` lists), so
    that two runs' environments compare in one field.

    Example::

        >>> from pipecomm.lab import results
        >>> sorted(results.installed_set())
        ['installed_sha256', 'lock_sha256']
    """
    lock = REPO_ROOT / "artifact" / "requirements-lock.txt"
    names = sorted({f"{(d.metadata['Name'] or '').lower()}=={d.version}"
                    for d in importlib.metadata.distributions()})
    return {"lock_sha256": hashlib.sha256(lock.read_bytes()).hexdigest() if lock.exists() else "",
            "installed_sha256": hashlib.sha256("\n".join(names).encode()).hexdigest()}


def describe_runs(df: pd.DataFrame) -> dict[str, Any]:
    """What the data says about how it was measured: backends, world sizes, networks."""
    out: dict[str, Any] = {}
    for col, key in (("backend", "backends"), ("world_size", "world_sizes"),
                     (NETWORK_COLUMN, "networks")):
        if col in df.columns:
            values = sorted({v for v in df[col].dropna().tolist()}, key=str)
            out[key] = [v.item() if hasattr(v, "item") else v for v in values]
    nets = out.get("networks", [])
    out["network_kinds"] = sorted({network_kind(n) for n in nets})
    out["emulated_network"] = any(str(n).startswith("emulated") for n in nets)
    out["analytic_only"] = bool(nets) and all(str(n).startswith("analytic") for n in nets)
    return out


# --------------------------------------------------------------------------- one experiment


#: Resolution of figure.png (a notebook shows it at :data:`pipecomm.lab.notebook.INLINE_DPI`).
FIGURE_DPI = 120


def save(
    out_dir: str | os.PathLike | None,
    df: pd.DataFrame,
    fig: Any = None,
    params: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path | None:
    """Write an experiment's data.csv, figure.png/.pdf, params.json and env.json into ``out_dir``.

    ``None`` writes nothing (an interactive notebook run). ``extra`` is merged into env.json (for
    example fitted parameters). Returns the directory.

    Example::

        >>> import tempfile
        >>> import pandas as pd
        >>> from pipecomm.lab import results
        >>> df, fig, out = pd.DataFrame({"nbytes": [1024], "time_s": [1e-4]}), None, tempfile.mkdtemp()
        >>> results.save(out + "/results/cpu/E0", df, fig, {"sizes_max": 1 << 20}).name
        'E0'
        >>> results.read_json(out + "/results/cpu/E0/params.json")
        {'sizes_max': 1048576}
    """
    if out_dir is None:
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "data.csv", df)
    if fig is not None:
        for ext in ("png", "pdf"):
            with atomic_path(out / f"figure.{ext}") as tmp:
                fig.savefig(tmp, format=ext, dpi=FIGURE_DPI, bbox_inches="tight")
    if params is not None:
        write_json(out / "params.json", dict(params))
    env = environment() | describe_runs(df)
    if (out / "env.json").exists():  # the orchestrator may have recorded the profile already
        env = read_json(out / "env.json") | env
    if extra:
        env |= dict(extra)
    write_json(out / "env.json", env)
    return out


def load_csv(path: str | os.PathLike) -> pd.DataFrame:
    """Read a finished run's data.csv (a file, possibly .gz, or the directory holding it); a
    path that does not exist is a FileNotFoundError saying so (a directory without data.csv:
    run the experiment first).

    Example::

        >>> from pipecomm.lab import results
        >>> df = results.load_csv(results.REPO_ROOT / "artifact/reference/cpu/E3")
        >>> len(df) > 0
        True
    """
    path = Path(path)
    if path.is_dir():  # a result directory, or a reference one (data.csv.gz)
        found = [path / n for n in ("data.csv", "data.csv.gz") if (path / n).exists()]
        if not found:
            raise FileNotFoundError(f"no data.csv in {path}: run the experiment first")
        path = found[0]
    if not path.exists():
        raise FileNotFoundError(f"no such file: {path}")
    return pd.read_csv(path, low_memory=False)  # whole-file dtypes: no mixed-type warning
