"""The subprocess side of the checkpoint fuzz test (``test_untrusted_checkpoint.py``).

python checkpoint_fuzz_worker.py DIR CASES   save one checkpoint under DIR, then CASES times: copy
                                             it, damage one file at random (seeded by the case
                                             number), load it into one engine; print a JSON
                                             summary, exit 1 if any case failed

A case passes when the load raises a clear error (``CheckpointError``, ``ConfigError`` or
another ``ValueError`` whose message names the checkpoint) or loads exactly: every weight,
Adam moment, accumulated gradient, counter, hyperparameter, the scheduler, the CPU RNG and
the client_state equal to the saved engine's. Half the cases are "forged": the manifest
is re-stamped with the damaged file's size and checksums, as an attacker would, so the
checks behind the CRCs are what stops them. A forger may legitimately change a JSON value
(a counter, a hyperparameter, an RNG state), so a forged case passes with a load whose
tensors equal the saved engine's and whose counters are non-negative ints; forged damage
is limited to JSON (files and safetensors headers), where no tensor data is touched. Each
case has a SIGALRM deadline, and the whole run a timeout in the test.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import signal
import struct
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import checkpoint_worker
import torch

from megatrain_ds import ConfigError
from megatrain_ds.checkpoint import save as checkpoint_save
from megatrain_ds.checkpoint.directories import LATEST_FILE, MANIFEST_FILE
from megatrain_ds.checkpoint.tensor_files import CheckpointError

TAG = "good"
CASE_SECONDS = 30
CLIENT_STATE = {"epoch": 3, "pair": (1, 2.5), "by_id": {7: "seven"}, "positions": torch.arange(5), "inf": math.inf}
COUNTERS = ("global_steps", "micro_steps", "optimizer_steps")  # the engine's (global_samples: DeepSpeed's adapter)
_VALUES = [None, True, 0, -1, 1.5, "x", [], {}, [1, 2], {"a": 1}, 2**40, {"$tensor": "tensor_99"}, {"$tuple": 5}]
_VALUES += [{"$dict": [[1]]}, {"$float": "nan"}, {"$unknown": 1}, "../x", "/abs", "global_step0"]


class CaseTimeout(BaseException):
    """Raised by the alarm: a hang, never caught as an ordinary error."""


def parameter_state(engine: Any, kinds: tuple[str, ...] = ("master", "exp_avg", "exp_avg_sq", "grad")) -> dict:
    """Each parameter's slice of the flat buffers (the padding between them is never saved)."""
    engine.settle_optimizer()  # the host state is read directly
    found = {}
    for index, state in enumerate(engine.states):
        for kind in kinds:
            flat = getattr(state, kind)
            for slot in state.layout.slots if flat is not None else ():
                found[f"{index}.{slot.name}.{kind}"] = flat[slot.offset : slot.offset + slot.numel].clone()
    return found


def snapshot(engine: Any) -> dict[str, Any]:
    return {
        "tensors": parameter_state(engine),
        "counters": {name: getattr(engine, name) for name in COUNTERS},
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups],
        "scheduler": engine.lr_scheduler.state_dict(),
        "rng": torch.get_rng_state(),
    }


def scramble(engine: Any) -> None:
    """So a load that claims success but leaves something unread is caught."""
    engine.settle_optimizer()  # no update in flight may write over the scrambled state
    for state in engine.states:
        for kind in ("master", "exp_avg", "exp_avg_sq", "grad"):
            if getattr(state, kind) is not None:
                getattr(state, kind).fill_(math.nan)
    for name in COUNTERS:
        setattr(engine, name, 987654)
    for group in engine.optimizer.param_groups:
        group["lr"] = -1.0
    engine.lr_scheduler.last_epoch = 12345
    torch.manual_seed(4242)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def check_exact(engine: Any, expected: dict[str, Any], client_state: Any) -> str | None:
    now = snapshot(engine)
    for key in ("tensors", "counters", "param_groups", "scheduler", "rng"):
        if not same(now[key], expected[key]):
            return f"loaded, but {key} differs from the saved engine's"
    return None if same(client_state, CLIENT_STATE) else "loaded, but client_state differs"


def check_forged(engine: Any, expected: dict[str, Any]) -> str | None:
    if not same(parameter_state(engine, ("master", "exp_avg", "exp_avg_sq")), expected["moments"]):
        return "a forged JSON edit changed loaded tensors"
    if not all(type(getattr(engine, name)) is int and getattr(engine, name) >= 0 for name in COUNTERS):
        return "a forged load left a counter that is not a non-negative int"
    return None


# -- damage ------------------------------------------------------------------------------------


def random_value(rng: random.Random, old: Any) -> Any:
    if rng.random() < 0.5:  # change the value, keeping its type
        if isinstance(old, bool):
            return not old
        if isinstance(old, int):
            return old + rng.choice([-1, 1, 1000, -(2 * old) - 1])
        if isinstance(old, float):
            return rng.choice([old * 2, -old, old + 1e-3])
        if isinstance(old, str):
            return rng.choice([old + "x", "", old[::-1]])
        if isinstance(old, list):
            return old[::-1] if len(old) > 1 else old + [0]
    return rng.choice(_VALUES)  # change the type (or a tag the decoder must refuse)


def edit_json(tree: Any, rng: random.Random) -> tuple[Any, str]:
    """One random edit at a random depth: change a value, delete, add, change a type."""
    path, parent, key = [], None, None
    node = tree
    while isinstance(node, (dict, list)) and node and (parent is None or rng.random() < 0.7):
        parent, key = node, rng.choice(list(node) if isinstance(node, dict) else range(len(node)))
        node = parent[key]
        path.append(key)
    op = rng.choice(["change", "delete", "add", "type"])
    if parent is None:
        return rng.choice(_VALUES), f"replace the document ({op})"
    if op == "delete":
        del parent[key]
    elif op == "add":
        if isinstance(parent, dict):
            parent[rng.choice(["extra", "$tuple", "params", "counters"])] = rng.choice(_VALUES)
        else:
            parent.insert(rng.randrange(len(parent) + 1), rng.choice(_VALUES))
    elif op == "type":
        parent[key] = rng.choice(_VALUES)
    else:
        parent[key] = random_value(rng, node)
    return tree, f"{op} at {path}"


def damage_json(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    tree, what = edit_json(json.loads(data), rng)
    return json.dumps(tree).encode(), what


def damage_header(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    (length,) = struct.unpack("<Q", data[:8])
    header, what = damage_json(data[8 : 8 + length].rstrip(b" "), rng)
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data[8 + length :], f"header: {what}"


def damage(path: Path, rng: random.Random, forged: bool) -> str:
    data = path.read_bytes()
    is_json = path.suffix == ".json"
    ops = ["edit"] + (["truncate", "flip"] if not forged or is_json or path.name == LATEST_FILE else ["truncate"])
    op = rng.choice(ops)
    if op == "truncate":
        cut = rng.randrange(len(data)) if data else 0
        path.write_bytes(data[:cut])
        return f"{path.name}: truncated to {cut} bytes"
    if op == "flip":
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(len(damaged))] ^= rng.randrange(1, 256)
        path.write_bytes(bytes(damaged))
        return f"{path.name}: bytes flipped"
    if path.name == LATEST_FILE:
        tag = rng.choice(["", "..", "../good", "/tmp", "good/..", "other", "good\x00", ".tmp-good", " good\n"])
        path.write_text(tag)
        return f"latest: {tag!r}"
    changed, what = damage_json(data, rng) if is_json else damage_header(data, rng)
    path.write_bytes(changed)
    return f"{path.name}: {what}"


def restamp(tag_dir: Path, name: str) -> None:
    """What an attacker does after editing ``name``: record its new size and checksums."""
    manifest = tag_dir / MANIFEST_FILE
    try:
        document = json.loads(manifest.read_bytes())
        body = document["body"]
        if name != MANIFEST_FILE:
            data = (tag_dir / name).read_bytes()
            record = {"bytes": len(data), "crc32": zlib.crc32(data)}
            if name.endswith(".safetensors") and len(data) >= 8:
                (length,) = struct.unpack("<Q", data[:8])
                record["header_crc32"] = zlib.crc32(data[: 8 + length])
            body["files"][name] = record
        document["crc32"] = zlib.crc32(json.dumps(body, sort_keys=True).encode())
    except (ValueError, KeyError, TypeError, IndexError):
        return  # the edit broke the manifest's own structure: nothing to re-stamp
    manifest.write_text(json.dumps(document))


# -- the run ---------------------------------------------------------------------------------


def run_case(number: int, saved: Path, work: Path, engine: Any, expected: dict[str, Any]) -> dict[str, Any]:
    rng = random.Random(number)
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(saved, work)
    tag_dir = work / TAG
    # The files a load parses as JSON count twice: their checks are the ones a forger meets.
    files = sorted(p.name for p in tag_dir.iterdir()) + [LATEST_FILE, "engine_state.json", MANIFEST_FILE]
    name = rng.choice(files)
    forged = rng.random() < 0.5 and name != LATEST_FILE
    what = damage(work / LATEST_FILE if name == LATEST_FILE else tag_dir / name, rng, forged)
    if forged:
        restamp(tag_dir, name)
    scramble(engine)
    outcome: dict[str, Any] = {"case": number, "damage": what, "forged": forged}
    signal.alarm(CASE_SECONDS)
    try:
        _, client_state = engine.load_checkpoint(work)
    except (CheckpointError, ConfigError, ValueError) as error:
        message = str(error)
        outcome["result"] = type(error).__name__
        if not message or (str(work) not in message and "checkpoint" not in message):
            outcome["failure"] = f"unclear error: {message!r}"
        return outcome
    except CaseTimeout:
        outcome["failure"] = f"no result within {CASE_SECONDS} s"
        return outcome
    except Exception as error:  # the fuzz's finding: report it, go on
        outcome["failure"] = f"{type(error).__name__}: {error}"
        return outcome
    finally:
        signal.alarm(0)
    outcome["result"] = "loaded"
    failure = check_forged(engine, expected) if forged else check_exact(engine, expected, client_state)
    if failure:
        outcome["failure"] = failure
    return outcome


def main(directory: str, cases: int) -> int:
    torch.set_num_threads(1)
    root = Path(directory)

    def on_alarm(*_: Any) -> None:
        raise CaseTimeout

    signal.signal(signal.SIGALRM, on_alarm)
    engine = checkpoint_worker.build(seed=0)
    checkpoint_worker.train(engine, 1)
    batch = checkpoint_worker.tiny_models.make_batch(engine.micro_steps)
    engine.backward(engine(**batch).loss)  # half an accumulation window: the accumulators are saved too
    engine.step()
    # Small shards: several files of each kind.
    checkpoint_save.save_checkpoint(engine, str(root / "saved"), TAG, CLIENT_STATE, max_shard_bytes=120_000)
    expected = snapshot(engine) | {"moments": parameter_state(engine, ("master", "exp_avg", "exp_avg_sq"))}
    engine.destroy()
    engine = checkpoint_worker.build(seed=1)
    started = time.perf_counter()
    outcomes = [run_case(number, root / "saved", root / "case", engine, expected) for number in range(cases)]
    results: dict[str, int] = {}
    for outcome in outcomes:
        key = outcome.get("result", "failed") + (" (forged)" if outcome["forged"] else "")
        results[key] = results.get(key, 0) + 1
    failures = [outcome for outcome in outcomes if "failure" in outcome]
    summary = {"cases": cases, "results": results, "seconds": time.perf_counter() - started, "failures": failures}
    print(json.dumps(summary, default=str))
    engine.destroy()
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
