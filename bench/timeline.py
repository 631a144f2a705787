"""One optimizer step of a megatrain trace as a timeline picture.

Reads the Chrome trace-event JSON that ``"megatrain": {"trace": "PATH.json"}`` writes
(``megatrain_ds/runtime/trace.py``) and draws one step: a row per track (step, compute, h2d, d2h,
stash, comm, optimizer worker), a box per span coloured by what it is, time in ms from the
step's first span, each row labelled with how busy it was. Spans nested in another of the
same row (AdamW ranges inside a worker chunk or the step finish) are drawn thinner, below.

    python bench/timeline.py TRACE.json --step 2 --out bench/results/timeline_cpu.png
    # record a trace first (a short CPU run of a model config), then draw it:
    python bench/timeline.py bench/results/timeline_cpu_tiny_llama.json --record \\
        --model configs/models/tiny_llama.json --seq-len 256 --micro-batch 4 \\
        --out bench/results/timeline_cpu_tiny_llama.png
    # stashed activations on their own track; MEGATRAIN_STREAM_CHECK=1 keeps the CPU's
    # "device" buffers apart, so the stash really copies to pinned host buffers and back:
    MEGATRAIN_STREAM_CHECK=1 python bench/timeline.py bench/results/timeline_cpu_tiny_llama_stash.json \\
        --record --recompute none --model configs/models/tiny_llama.json --seq-len 256 --micro-batch 4

Open the same JSON at https://ui.perfetto.dev to zoom and read each span's arguments.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

TRACK_ORDER = ("step", "compute", "h2d", "d2h", "stash", "comm", "optimizer worker")
COLOURS = {
    "forward": "#4c72b0",
    "recompute": "#8fa9d6",
    "backward": "#dd8452",
    "weights": "#55a868",
    "grads": "#c44e52",
    "all-reduce": "#8172b3",
    "consume": "#937860",
    "adamw": "#da8bc3",
    "step finish": "#8c8c8c",
    "step": "#cfcfcf",
    "stash": "#2a9d8f",
    "unstash": "#e9c46a",
}
_EXTRA_COLOURS = ("#64b5cd", "#ccb974", "#4c4c4c", "#b07aa1")


def load_spans(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(spans, otherData)``: each span as ``{name, track, start_ms, end_ms, args}``."""
    document = json.loads(Path(path).read_text())
    events = document["traceEvents"]
    track_of = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    spans = [
        {
            "name": e["name"],
            "track": track_of.get((e["pid"], e["tid"]), e.get("cat", "?")),
            "start_ms": e["ts"] / 1e3,
            "end_ms": (e["ts"] + e["dur"]) / 1e3,
            "args": e.get("args", {}),
        }
        for e in events
        if e.get("ph") == "X"
    ]
    return spans, document.get("otherData", {})


def steps_in(spans: list[dict[str, Any]]) -> list[int]:
    return sorted({s["args"]["step"] for s in spans if "step" in s["args"]})


def kind_of(name: str) -> str:
    """The colour key: the name without its block/state number."""
    words = [w for w in name.split() if not w.isdigit()]
    return " ".join(words) or name


def nesting_depths(spans: list[dict[str, Any]]) -> list[int]:
    """Per span (of one track, sorted by start), how many spans of the track enclose it."""
    depths, open_ends = [], []
    for span in spans:
        while open_ends and open_ends[-1] <= span["start_ms"]:
            open_ends.pop()
        depths.append(len(open_ends))
        open_ends.append(span["end_ms"])
    return depths


def busy_ms(spans: list[dict[str, Any]]) -> float:
    """Length of the union of the spans' intervals."""
    total, cursor = 0.0, float("-inf")
    for span in sorted(spans, key=lambda s: s["start_ms"]):
        start = max(span["start_ms"], cursor)
        if span["end_ms"] > start:
            total += span["end_ms"] - start
            cursor = span["end_ms"]
    return total


def render(spans: list[dict[str, Any]], meta: dict[str, Any], step: int, out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    chosen = [s for s in spans if s["args"].get("step") == step]
    if not chosen:
        raise SystemExit(f"no spans of step {step}; the trace has steps {steps_in(spans)}")
    origin = min(s["start_ms"] for s in chosen)
    length = max(s["end_ms"] for s in chosen) - origin
    by_track: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in chosen:
        by_track[span["track"]].append(span)
    tracks = [t for t in TRACK_ORDER if t in by_track] + sorted(set(by_track) - set(TRACK_ORDER))

    figure, axes = plt.subplots(figsize=(14, 1.0 + 0.75 * len(tracks)))
    colours = dict(COLOURS)
    extra = itertools.cycle(_EXTRA_COLOURS)
    labels = []
    for row, track in enumerate(tracks):
        items = sorted(by_track[track], key=lambda s: (s["start_ms"], -s["end_ms"]))
        for span, depth in zip(items, nesting_depths(items)):
            kind = kind_of(span["name"])
            if kind not in colours:
                colours[kind] = next(extra)
            colour = colours[kind]
            height = 0.7 if depth == 0 else 0.3
            bottom = row - 0.35 if depth == 0 else row - 0.35 + 0.05
            start, width = span["start_ms"] - origin, span["end_ms"] - span["start_ms"]
            axes.broken_barh(
                [(start, width)],
                (bottom, height),
                facecolors=colour,
                edgecolors="white" if depth == 0 else colour,
                linewidth=0.3,
            )
            if depth == 0 and width > 0.035 * length and track != "step":
                axes.text(start + width / 2, row, span["name"], ha="center", va="center", fontsize=7, clip_on=True)
        top = [s for s, d in zip(items, nesting_depths(items)) if d == 0]
        labels.append(track if track == "step" else f"{track}\n{100 * busy_ms(top) / length:.0f}% busy")
    axes.set_yticks(range(len(tracks)), labels, fontsize=9)
    axes.set_ylim(len(tracks) - 0.5, -0.5)
    axes.set_xlim(0, length)
    axes.set_xlabel("ms since the step's first span")
    axes.grid(axis="x", alpha=0.3)
    used = {kind_of(s["name"]) for s in chosen}
    axes.legend(
        handles=[Patch(color=colours[k], label=k) for k in colours if k in used],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12 - 0.3 / len(tracks)),
        ncol=10,
        fontsize=8,
        frameon=False,
    )
    settings = [
        f"micro-batch {meta['micro_batch']}" if "micro_batch" in meta else "",
        f"x {meta['seq_len']} tokens" if "seq_len" in meta else "",
        ("bf16" if meta["bf16"] else "fp32") if "bf16" in meta else "",
        (
            f"recompute {meta['recompute']['setting']!r}: {meta['recompute']['stashed_blocks']} blocks stashed"
            if isinstance(meta.get("recompute"), dict)
            else ""
        ),
        "MEGATRAIN_STREAM_CHECK=1" if meta.get("stream_check") else "",
    ]
    settings_text = " ".join(part for part in settings if part)
    axes.set_title(
        f"{meta.get('model', 'model')} on {meta.get('device', '?')}: optimizer step {step}, "
        f"{length:.1f} ms" + (f" ({settings_text})" if settings_text else ""),
        fontsize=10,
    )
    figure.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=130)
    plt.close(figure)
    return out


def record(
    trace: Path,
    model_config: str,
    seq_len: int,
    micro_batch: int,
    steps: int,
    threads: int,
    device: str = "cpu",
    recompute: str | int | None = None,
    command: str = "",
) -> None:
    """Train a random-init model of ``model_config`` on ``device`` for ``1 + steps`` steps, traced
    (bf16 compute on CUDA, fp32 on the CPU); ``recompute``: the engine's ``"recompute"``
    (its default when ``None``)."""
    import torch
    import transformers

    from megatrain_ds import MegatrainEngine, parse_engine_config

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    config = transformers.AutoConfig.for_model(**json.loads(Path(model_config).read_text()))
    model = transformers.AutoModelForCausalLM.from_config(config)
    engine = MegatrainEngine(
        model,
        parse_engine_config(
            {
                "engine": "megatrain",
                "train_micro_batch_size_per_gpu": micro_batch,
                "gradient_clipping": 1.0,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                "bf16": {"enabled": device == "cuda"},
                "megatrain": {
                    "trace": str(trace),
                    "trace_steps": steps,
                    **({"recompute": recompute} if recompute is not None else {}),
                },
            }
        ),
        device=torch.device(device),
    )
    try:
        for _step in range(1 + steps):
            ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len), device=device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
    finally:
        engine.destroy()
    # The engine does not know the batch; add it for the title.
    document = json.loads(trace.read_text())
    checked = os.environ.get("MEGATRAIN_STREAM_CHECK") == "1"
    document["otherData"].update(
        tokens_per_micro_batch=micro_batch * seq_len,
        seq_len=seq_len,
        model_config=model_config,
        threads=threads,
        stream_check=checked,
        **({"recorded_with": command} if command else {}),
    )
    if checked:
        document["otherData"]["stream_check_note"] = (
            "MEGATRAIN_STREAM_CHECK=1: the CPU runtime keeps its 'device' buffers apart from the host's, so "
            "copies (the activation stash to pinned host buffers and back included) really run, as on a GPU; "
            "every op also goes through the race checker, so spans are longer than a plain CPU run's"
        )
    trace.write_text(json.dumps(document, separators=(",", ":")) + "\n")


def _recompute(value: str) -> str | int:
    return int(value) if value.isdigit() else value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="trace JSON (written by the engine, or by --record)")
    parser.add_argument("--step", type=int, default=None, help="optimizer step to draw (default: the last traced)")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: the trace's, .png)")
    recording = parser.add_argument_group("--record: run a short traced training first")
    recording.add_argument("--record", action="store_true")
    recording.add_argument("--model", default="configs/models/tiny_llama.json", help="model config JSON")
    recording.add_argument("--seq-len", type=int, default=256)
    recording.add_argument("--micro-batch", type=int, default=4)
    recording.add_argument("--steps", type=int, default=2, help="traced steps (after one warm-up step)")
    recording.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    recording.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model computes")
    recording.add_argument(
        "--recompute",
        type=_recompute,
        default=None,
        help="the engine's \"recompute\": full, none, auto or N (default: the engine's)",
    )
    args = parser.parse_args(argv)
    if args.record:
        env = "MEGATRAIN_STREAM_CHECK=1 " if os.environ.get("MEGATRAIN_STREAM_CHECK") == "1" else ""
        command = env + "python bench/timeline.py " + " ".join(sys.argv[1:] if argv is None else argv)
        record(
            args.trace,
            args.model,
            args.seq_len,
            args.micro_batch,
            args.steps,
            args.threads,
            args.device,
            args.recompute,
            command,
        )
    spans, meta = load_spans(args.trace)
    step = args.step if args.step is not None else steps_in(spans)[-1]
    out = render(spans, meta, step, args.out or args.trace.with_suffix(".png"))
    print(f"wrote {out} (step {step} of {steps_in(spans)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
