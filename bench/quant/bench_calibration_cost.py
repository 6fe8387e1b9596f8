"""What calibration costs against the ONNX Runtime forward passes it needs: the plain model run
over the calibration tokens (same session settings: CPU, optimizations off), then the importance
calibration, then with GPTQ's X^T X, then the whole `--recipe q4m` quantization with its phases
(calibration, factors, pass), in-process, one process, `--rounds` times.

    OPENBLAS_NUM_THREADS=1 nice python bench/quant/bench_calibration_cost.py \
        /tmp/q1-recipes/fp16/model.onnx --hf /work/cache/smollm2 [--calibration builtin|sampled]

With ``sampled`` the text is sampled once (its time printed) and the same tokens are fed to
every row; the q4m row samples again, as a user's run does.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_recipes import cost


def plain_forward_seconds(model: object, batches: list, workdir: str) -> float:
    """ONNX Runtime running the uninstrumented model over ``batches`` as calibration runs it."""
    import onnx
    from fastopt.quant.activation_ranges import _PLACEHOLDER, _session
    from fastopt.quant.token_feeds import ids_input, token_feeds

    skeleton = model.skeleton()  # type: ignore[attr-defined]
    ids_name = ids_input(model)  # type: ignore[arg-type]
    with ExitStack() as stack:
        proto = onnx.load_from_string(skeleton)
        sess = _session(proto, skeleton.count(_PLACEHOLDER), model, stack, workdir)
        wanted = {i.name for i in sess.get_inputs()}
        out = [sess.get_outputs()[0].name]
        t0 = time.perf_counter()
        for ids in batches:
            sess.run(out, token_feeds(model, ids_name, ids, wanted))  # type: ignore[arg-type]
        return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--hf", help="folder with the tokenizer (hf_config)")
    ap.add_argument("--calibration", default="builtin")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import fastopt
    from fastopt.quant.calibration import (
        calibration_text,
        collect_importance,
        find_tokenizer,
        tokenizer_folders,
    )
    from fastopt.quant.recipe import recipe_settings
    from fastopt.quant.sampled_text import sample_calibration

    model = fastopt.load(args.model)
    work = tempfile.mkdtemp(prefix="calib-cost-")
    folders = tokenizer_folders(model, args.hf)
    if args.calibration == "sampled":
        sampled = sample_calibration(model, folders, work, "bench")
        batches = sampled.batches
        print(f"sampling: {sampled.seconds:.2f} s ({sampled.source})")
    else:
        from fastopt.quant.calibration import SEQUENCE, _chunks

        encode, _ = find_tokenizer(folders)
        assert encode is not None, "no tokenizer: pass --hf or --calibration sampled"
        batches = _chunks(encode(calibration_text(args.calibration)), SEQUENCE, 4096)
    tokens = sum(int(b.size) for b in batches)
    print(f"{tokens} tokens in {len(batches)} sequences")
    for r in range(args.rounds):
        plain = plain_forward_seconds(model, batches, work)
        imp = collect_importance(model, token_batches=batches, workdir=work)
        hes = collect_importance(model, token_batches=batches, workdir=work, hessians=True)
        hes_s, hes_runs = hes.seconds, hes.forward_seconds
        del hes  # (its X^T X: not two rounds' at once)
        settings = recipe_settings("q4m", calibrated=True)
        settings.update(calibration=args.calibration, hf_config=args.hf, recipe="q4m")
        t0 = time.perf_counter()
        report = fastopt.quantize(
            args.model, Path(work) / "q.onnx", mode="int4", run_check=False, **settings
        )
        q4m = time.perf_counter() - t0
        print(
            f"round {r}: plain forward {plain:.2f} s; importance {imp.seconds:.2f} s (runs "
            f"{imp.forward_seconds:.2f} s); with X^T X {hes_s:.2f} s (runs {hes_runs:.2f} s); "
            f"q4m + GPTQ {q4m:.2f} s ({cost(report)})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
