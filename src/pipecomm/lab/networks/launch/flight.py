"""The flight recorder's dumps: written by every rank that fails or is stopped, lined up after.

With ``PIPECOMM_FLIGHT_DIR=DIR`` in the environment, every rank a local pool
(:class:`pipecomm.lab.networks.launch.Ranks`) or a torchrun job
(:func:`pipecomm.lab.networks.launch.init_from_env`) starts keeps the last
``PIPECOMM_FLIGHT_STEPS`` (1024) point-to-point messages of pipecomm's schedules
(:func:`pipecomm.observe.flight`) and writes them to ``DIR/flight_rank<r>.json`` when its
function raises (a timeout, a :class:`~pipecomm.collectives.MismatchError`, a dead peer) or when
its launcher stops it (SIGTERM: the pool after another rank's :class:`RankError`, torchrun after
a worker's failure). Then::

    python -m pipecomm.lab.networks.launch.flight DIR

lines the dumps up (per rank: why it dumped, its last completed message, what it still waits
for) and names the first message a rank waits for that its peer never sent, following the
chain of waiting ranks to the one that waits for nobody: the rank that stopped, and where.

Example::

    >>> import json, tempfile
    >>> from pathlib import Path
    >>> d = Path(tempfile.mkdtemp())
    >>> m = dict(collective="pipecomm.allreduce.lp", call=0, step=5, peer=1, bytes=4096,
    ...          posted=1.0, waited=2.0, completed=None)
    >>> _ = (d / "flight_rank2.json").write_text(json.dumps(dict(rank=2, reasons=["timeout"],
    ...     messages=[dict(m, op="recv", block=3)])))
    >>> _ = (d / "flight_rank1.json").write_text(json.dumps(dict(rank=1, reasons=["SIGTERM"],
    ...     messages=[dict(m, op="send", peer=2, block=2, completed=1.5)])))
    >>> print(diagnose(load(d))["text"])
    rank 2 waits (step 5 of pipecomm.allreduce.lp, call 0) for block 3 from rank 1, which rank 1 never sent (its last send to rank 2 there: block 2); rank 1 waits for nobody: it stopped after its sends block 2 to rank 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["ENV_DIR", "ENV_STEPS", "diagnose", "dump", "install", "load", "main", "report"]

ENV_DIR = "PIPECOMM_FLIGHT_DIR"
ENV_STEPS = "PIPECOMM_FLIGHT_STEPS"
_STATE: dict[str, Any] = {"dir": None, "reasons": []}


def install(directory: str | os.PathLike | None = None, steps: int | None = None) -> bool:
    """Record this rank's messages (:func:`pipecomm.observe.flight`, ``steps`` of them) and dump
    them to ``directory`` (``None``: ``$PIPECOMM_FLIGHT_DIR``; unset: do nothing, return False)
    on :func:`dump` and on SIGTERM. Called by every rank the lab starts.

    Example::

        >>> install(None) if ENV_DIR not in os.environ else False    # the variable unset
        False
    """
    from pipecomm import observe

    directory = directory or os.environ.get(ENV_DIR) or None
    if directory is None:
        return False
    observe.flight(int(steps or os.environ.get(ENV_STEPS) or 1024))
    _STATE.update(dir=Path(directory), reasons=[])
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum: int, frame: Any) -> None:
            dump("SIGTERM: stopped by its launcher")
            signal.signal(signum, previous if callable(previous) else signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, on_term)
    return True


def dump(reason: str, directory: str | os.PathLike | None = None) -> Path | None:
    """Write this rank's recorded messages and ``reason`` (with the reasons of earlier dumps of
    this process) to ``directory/flight_rank<r>.json`` (``None``: :func:`install`'s); ``None``
    when there is nowhere to write.

    Example::

        >>> import tempfile
        >>> dump("a test", tempfile.mkdtemp()).name     # outside a job: rank from $RANK, else 0
        'flight_rank0.json'
    """
    import torch.distributed as dist

    from pipecomm import observe

    target = Path(directory) if directory is not None else _STATE["dir"]
    if target is None:
        return None
    _STATE["reasons"].append(str(reason)[:2000])
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    world = dist.get_world_size() if dist.is_initialized() else None
    body = dict(rank=rank, world_size=world, host=socket.gethostname(), pid=os.getpid(),
                time=time.time(), reasons=list(_STATE["reasons"]),
                messages=observe.flight_records())
    target.mkdir(parents=True, exist_ok=True)
    path = target / f"flight_rank{rank}.json"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)
    return path


def load(directory: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """The dumps in ``directory`` by rank (``flight_rank<r>.json``; unreadable ones skipped).

    Example::

        >>> import tempfile
        >>> load(tempfile.mkdtemp())
        {}
    """
    out = {}
    for path in sorted(Path(directory).glob("flight_rank*.json")):
        with contextlib.suppress(ValueError, OSError):
            body = json.loads(path.read_text())
            out[int(body["rank"])] = body
    return dict(sorted(out.items()))


def _waits(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A rank's messages it waited for that never completed, first waited first."""
    return sorted((m for m in body.get("messages", ()) if m.get("waited") is not None
                   and m.get("completed") is None), key=lambda m: m["waited"])


def _counterpart(dumps: dict[int, dict], rank: int, m: dict) -> tuple[str, Any]:
    """What ``m``'s peer did with the message ``rank`` waits for: ``("no dump", None)``,
    ``("never", last message of that stream)`` or ``("posted", its entry)``."""
    peer = m["peer"]
    if peer not in dumps:
        return "no dump", None
    op = "send" if m["op"] == "recv" else "recv"
    same = [x for x in dumps[peer].get("messages", ()) if x["op"] == op and x["peer"] == rank
            and x["collective"] == m["collective"] and x["call"] == m["call"]]
    match = [x for x in same if x["block"] == m["block"]]
    if match:
        return "posted", match[0]
    return "never", max(same, key=lambda x: x["block"], default=None)


def diagnose(dumps: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The first message (earliest waited for) that a rank waits for and its peer never posted,
    and the rank at the end of the chain of waits from there (``stopped``: the peer, or the
    rank it waits for, and so on, until one that waits for nobody or left no dump): a dict of
    ``waiter``, ``peer``, ``stopped``, ``message`` (the waiter's entry) and ``text``; ``None``
    when no rank waits for a message never sent.

    Example::

        >>> diagnose({0: {"rank": 0, "messages": []}}) is None
        True
    """
    found = []
    for rank, body in dumps.items():
        for m in _waits(body):
            what, other = _counterpart(dumps, rank, m)
            if what != "posted":
                found.append((m["waited"], rank, m, what, other))
    if not found:
        return None
    _, rank, m, what, other = min(found, key=lambda f: f[0])
    verb = "sent" if m["op"] == "recv" else "received"
    text = (f"rank {rank} waits (step {m['step']} of {m['collective']}, call {m['call']}) for "
            f"block {m['block']} {'from' if m['op'] == 'recv' else 'to'} rank {m['peer']}, ")
    if what == "no dump":
        text += f"and rank {m['peer']} left no dump (killed before it could write one?)"
    else:
        last = "none" if other is None else f"block {other['block']}"
        text += (f"which rank {m['peer']} never {verb} (its last {'send' if verb == 'sent' else 'receive'} "
                 f"{'to' if verb == 'sent' else 'from'} rank {rank} there: {last})")
    chain, stopped = [rank], m["peer"]
    while stopped in dumps and stopped not in chain and _waits(dumps[stopped]):
        chain.append(stopped)
        stopped = _waits(dumps[stopped])[0]["peer"]
    if stopped in dumps:
        via = " -> ".join(f"rank {r}" for r in chain[1:])
        last: dict[int, dict] = {}
        for x in dumps[stopped].get("messages", ()):
            if x["op"] == "send" and x["call"] == m["call"]:
                last[x["peer"]] = x
        sends = ", ".join(f"block {x['block']} to rank {q}" for q, x in sorted(last.items()))
        text += (f"; {via} waits for rank {stopped}" if via else "") + \
            f"; rank {stopped} waits for nobody: it stopped after its sends {sends or '(none)'}"
    return dict(waiter=rank, peer=m["peer"], stopped=stopped, message=m, text=text)


def report(directory: str | os.PathLike) -> str:
    """The dumps of ``directory`` lined up, one line per rank (why it dumped, its messages, its
    last completed one, the first it still waits for), then :func:`diagnose`'s finding.

    Example::

        >>> import tempfile
        >>> print(report(tempfile.mkdtemp()))
        no flight recorder dumps (flight_rank<r>.json) in ...
    """
    return _report(directory, load(directory))


def _report(directory: str | os.PathLike, dumps: dict[int, dict[str, Any]]) -> str:
    if not dumps:
        return f"no flight recorder dumps (flight_rank<r>.json) in {directory}"
    world = max([b.get("world_size") or 0 for b in dumps.values()] + [max(dumps) + 1])
    lines = []
    for rank in range(world):
        body = dumps.get(rank)
        if body is None:
            lines.append(f"rank {rank}: no dump")
            continue
        msgs = body.get("messages", [])
        done = [x for x in msgs if x.get("completed") is not None]
        waits = _waits(body)

        def show(x: dict) -> str:
            return (f"{x['op']} block {x['block']} {'to' if x['op'] == 'send' else 'from'} rank "
                    f"{x['peer']} (step {x['step']} of {x['collective']}, call {x['call']})")

        last = show(max(done, key=lambda x: x["completed"])) if done else "none"
        lines.append(f"rank {rank}: {len(msgs)} messages; dumped on {' / '.join(body['reasons'])}"
                     f"\n    last completed: {last}"
                     f"\n    waits for: {show(waits[0]) if waits else 'nothing'}")
    found = diagnose(dumps)
    lines.append("first wait for a message never sent: " + (found["text"] if found else "none"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m pipecomm.lab.networks.launch.flight DIR``: print :func:`report`; exit 1 when a
    rank waits for a message never sent, 2 without dumps.

    Example::

        >>> import tempfile
        >>> main([tempfile.mkdtemp()])
        no flight recorder dumps (flight_rank<r>.json) in ...
        2
    """
    p = argparse.ArgumentParser(description="Line up pipecomm's flight recorder dumps.")
    p.add_argument("directory", help="where the ranks wrote flight_rank<r>.json")
    args = p.parse_args(argv)
    dumps = load(args.directory)
    print(_report(args.directory, dumps))
    return 2 if not dumps else (1 if diagnose(dumps) else 0)


if __name__ == "__main__":
    raise SystemExit(main())
