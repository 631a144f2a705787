"""Does DeepSpeed ZeRO-3 offload fit a Llama on a host, by DeepSpeed's own estimator and by
the host bytes per parameter measured side by side on a GPU?

Issue 42 asks to show that ZeRO-3 offload does not fit Llama-2-7B's shape on the GPU
machine's 128 GiB host, "by its own error or its estimator". This runs DeepSpeed's
``estimate_zero3_model_states_mem_needs`` (``offload_param`` and ``offload_optimizer`` on
the CPU, ``zero.Init``, its default 1.5x buffer factor) for the shape, and scales the peak
host bytes per parameter that ``bench/compare.py`` measured for ZeRO-3 offload and for the
engine on the same machine (``--measured``: a compare JSON) to the shape. Arithmetic only:
it runs on any machine.

    python bench/zero3_estimate.py --measured bench/results/gpu_H200/2026-11-27-third/compare_3b.json \
        --out bench/results/zero3_estimate_7b.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the estimator is arithmetic; no device needed

GIB = 2**30


def llama_params(hidden: int, intermediate: int, layers: int, vocab: int) -> tuple[int, int]:
    """All parameters and the largest layer's of ``bench/compare.py``'s Llama: per block q, k,
    v, o (``4 h^2``), gate, up, down (``3 h i``) and two norms; an untied embedding and head
    (``V h`` each, the largest layers) and the final norm."""
    block = 4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden
    return layers * block + 2 * vocab * hidden + hidden, vocab * hidden


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--host-gib", type=float, default=128.0, help="the host's memory (the GPU machine's: 128)")
    parser.add_argument("--measured", type=Path, help="a bench/compare.py JSON with zero3_offload and megatrain rows")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    params, largest = llama_params(args.hidden, args.intermediate, args.layers, args.vocab)
    cpu_bytes, gpu_bytes, _ = estimate_zero3_model_states_mem_needs(params, largest, num_gpus_per_node=1)
    rows = {"deepspeed_estimator_zero3_offload": cpu_bytes}
    if args.measured:
        measured = json.loads(args.measured.read_text())["results"]
        for system, result in measured.items():
            rows[f"measured_{system}_scaled"] = int(result["bytes_per_param"] * params)
    host = args.host_gib * GIB
    print(f"Llama {params / 1e9:.2f}B parameters, host {args.host_gib:.0f} GiB")
    for name, needed in rows.items():
        verdict = "fits" if needed <= host else "does not fit"
        print(f"  {name:48s} {needed / GIB:8.1f} GiB ({needed / params:5.1f} B/param): {verdict}")
    if args.out:
        result = {
            "params": params,
            "host_bytes": int(host),
            "host_bytes_needed": rows,
            "zero3_estimator_gpu_bytes": gpu_bytes,
            "measured_from": str(args.measured) if args.measured else None,
        }
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
